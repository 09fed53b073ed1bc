"""Server-side SVG charts: no JavaScript, no build step, nothing fetched from outside.

Three shapes cover what operators look at: a latency histogram, a time series, and
horizontal bars per job. Output is inline SVG markup (safe: every text is escaped) that
uses presentation attributes only, so the strict Content-Security-Policy holds.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

from markupsafe import Markup, escape

W, H = 520, 190
PAD_L, PAD_R, PAD_T, PAD_B = 46, 12, 26, 34
INK, MUTED, GRID, ACCENT, FILL = "#1f2933", "#6b7785", "#e4e8ee", "#2563eb", "#dbe7fd"


def _fmt(v: float) -> str:
    if 0 < v < 0.01:
        return "<0.01"
    if v >= 1000:
        return f"{v / 1000:.1f}k"
    if v == int(v):
        return str(int(v))
    return f"{v:.2f}" if v < 10 else f"{v:.1f}"


def _frame(title: str, body: list[str], label: str) -> Markup:
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" class="chart" '
        f'role="img" aria-label="{escape(label)}">'
        f'<text x="{PAD_L}" y="16" font-size="12" font-weight="600" fill="{INK}">'
        f"{escape(title)}</text>"
    )
    return Markup(head + "".join(body) + "</svg>")  # noqa: S704 (all parts escaped above)


def _headline(text: str) -> str:
    """The chart's one figure (a count, the latest value) in its top-right corner."""
    return (
        f'<text x="{W - PAD_R}" y="16" font-size="11" text-anchor="end" fill="{MUTED}">'
        f"{escape(text)}</text>"
    )


def _y_axis(top: float) -> list[str]:
    out = []
    for i in range(5):
        v = top * i / 4
        y = H - PAD_B - (H - PAD_T - PAD_B) * i / 4
        out.append(
            f'<line x1="{PAD_L}" x2="{W - PAD_R}" y1="{y:.1f}" y2="{y:.1f}" stroke="{GRID}"/>'
            f'<text x="{PAD_L - 6}" y="{y + 4:.1f}" font-size="10" text-anchor="end" '
            f'fill="{MUTED}">{escape(_fmt(v))}</text>'
        )
    return out


def _nice_top(value: float) -> float:
    if value <= 0:
        return 1.0
    for step in (1, 2, 2.5, 5, 10):
        for scale in (0.01, 0.1, 1, 10, 100, 1000, 10_000, 100_000, 1_000_000):
            if step * scale >= value:
                return step * scale
    return value


def _empty(title: str) -> Markup:
    return _frame(
        title,
        [
            f'<text x="{W / 2}" y="{H / 2}" font-size="12" text-anchor="middle" '
            f'fill="{MUTED}">no data in this window</text>'
        ],
        f"{title}: no data",
    )


def histogram(title: str, bounds: Sequence[float], cumulative: Sequence[int], unit: str) -> Markup:
    """Bars per bucket from cumulative counts (the last one is +Inf)."""
    counts = [cumulative[0]] + [
        cumulative[i] - cumulative[i - 1] for i in range(1, len(cumulative))
    ]
    if not any(counts):
        return _empty(title)
    labels = [f"≤{_fmt(b)}" for b in bounds] + [f">{_fmt(bounds[-1])}"]
    title = f"{title} ({unit.strip()})" if unit.strip() else title
    top = _nice_top(max(counts))
    plot_w, plot_h = W - PAD_L - PAD_R, H - PAD_T - PAD_B
    slot = plot_w / len(counts)
    body = _y_axis(top)
    for i, (n, label) in enumerate(zip(counts, labels, strict=True)):
        h = plot_h * n / top
        x = PAD_L + i * slot + 2
        y = H - PAD_B - h
        body.append(
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{slot - 4:.1f}" height="{h:.1f}" '
            f'fill="{ACCENT}" rx="1"><title>{escape(label)}: {n}</title></rect>'
        )
        body.append(  # every bucket labelled: a bar without a label is a guess
            f'<text x="{x + (slot - 4) / 2:.1f}" y="{H - PAD_B + 13}" font-size="9" '
            f'text-anchor="middle" fill="{MUTED}">{escape(label)}</text>'
        )
    total = cumulative[-1]
    body.append(_headline(f"n={total}"))
    return _frame(title, body, f"{title}: {total} samples")


def series(title: str, points: Sequence[tuple[dt.datetime, float]], unit: str = "") -> Markup:
    """A line with a filled area over time; x labels at both ends and the middle."""
    if not points:
        return _empty(title)
    values = [v for _, v in points]
    top = _nice_top(max(values))
    plot_w, plot_h = W - PAD_L - PAD_R, H - PAD_T - PAD_B
    n = len(points)
    xs = [PAD_L + plot_w * (i / (n - 1) if n > 1 else 0.5) for i in range(n)]
    ys = [H - PAD_B - plot_h * v / top for v in values]
    line = " ".join(f"{x:.1f},{y:.1f}" for x, y in zip(xs, ys, strict=True))
    area = f"{xs[0]:.1f},{H - PAD_B} {line} {xs[-1]:.1f},{H - PAD_B}"
    body = _y_axis(top)
    body.append(f'<polygon points="{area}" fill="{FILL}"/>')
    body.append(f'<polyline points="{line}" fill="none" stroke="{ACCENT}" stroke-width="1.8"/>')
    for i in sorted({0, n // 2, n - 1}):
        anchor = "start" if i == 0 else ("end" if i == n - 1 else "middle")
        body.append(
            f'<text x="{xs[i]:.1f}" y="{H - PAD_B + 14}" font-size="10" text-anchor="{anchor}" '
            f'fill="{MUTED}">{points[i][0].astimezone(dt.UTC):%H:%M}</text>'
        )
    last = values[-1]
    body.append(_headline(f"now {_fmt(last)}{unit}"))
    return _frame(title, body, f"{title}: latest {_fmt(last)}{unit}")


def bars(title: str, items: Sequence[tuple[str, float]], unit: str = "") -> Markup:
    """Horizontal bars, one per label (jobs), largest first."""
    if not items:
        return _empty(title)
    items = list(items)[:8]
    top = _nice_top(max(v for _, v in items))
    label_w = 120
    row_h = min(20.0, (H - PAD_T - 8) / len(items))
    body = []
    for i, (label, v) in enumerate(items):
        y = PAD_T + i * row_h
        w = (W - label_w - 70) * v / top
        short = label if len(label) <= 18 else label[:17] + "…"
        body.append(
            f'<text x="{label_w - 6}" y="{y + row_h * 0.7:.1f}" font-size="11" text-anchor="end" '
            f'fill="{INK}">{escape(short)}</text>'
            f'<rect x="{label_w}" y="{y + 2:.1f}" width="{max(w, 1):.1f}" height="{row_h - 5:.1f}" '
            f'fill="{ACCENT}" rx="1"><title>{escape(label)}: {escape(_fmt(v))}{escape(unit)}'
            f"</title></rect>"
            f'<text x="{label_w + max(w, 1) + 5:.1f}" y="{y + row_h * 0.7:.1f}" font-size="10" '
            f'fill="{MUTED}">{escape(_fmt(v))}{escape(unit)}</text>'
        )
    return _frame(title, body, f"{title}: {len(items)} jobs")

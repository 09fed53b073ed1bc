"""``sandman replay TRACE`` (pool sizing from a trace) and ``sandman trace export``.

Registered by ``broker.cli.main``. The simulator needs no services; the export reads the
ledger (embedded PostgreSQL unless ``SANDMAN_DATABASE_URL`` is set).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click


def _warm_map(values: tuple[str, ...]) -> dict[str, int]:
    out: dict[str, int] = {}
    for value in values:
        image, sep, size = value.rpartition("=")
        if not sep or not image:
            raise click.BadParameter(f"{value!r}: expected IMAGE=SIZE")
        try:
            out[image] = int(size)
        except ValueError as exc:
            raise click.BadParameter(f"{value!r}: size must be an integer") from exc
    return out


def _floats(text: str | None) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()] if text else []


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def _row(label: str, result: dict[str, Any]) -> str:
    return (
        f"{label:<22} hit {result['hit_rate'] * 100:6.2f}%  wait p50 {_fmt(result['wait_p50_s'])}s"
        f" p90 {_fmt(result['wait_p90_s'])}s p99 {_fmt(result['wait_p99_s'])}s"
        f" mean {_fmt(result['wait_mean_s'])}s  creates {result['creates']}"
        f" ({_fmt(result['creates_per_request'])}/req)  idle {result['idle_pod_hours']:.3f}"
        f" pod-h  total {result['total_pod_hours']:.3f} pod-h"
    )


Command = Callable[..., Any]
Decorator = Callable[[Command], Command]


def _shown(decl: str, dest: str, default: Any, help: str | None = None, **kw: Any) -> Decorator:
    """A policy option that shows its default; ``dest`` is the ``Policy`` field it sets."""
    return click.option(decl, dest, default=default, show_default=True, help=help, **kw)


# One option per ``Policy`` field, each stored under the field's own name, so ``replay``
# builds the policy in one step instead of copying its options across one by one.
_POLICY_OPTIONS: tuple[Decorator, ...] = (
    _shown("--warm-default", "warm_default", 0, "Pool size for every image not named by --warm."),
    _shown("--idle-timeout", "idle_timeout_s", 300.0),
    _shown(
        "--refill",
        "refill",
        "always",
        "always: upkeep keeps pools full (the broker today); "
        "demand: refill only after a request for that image.",
        type=click.Choice(["always", "demand"]),
    ),
    _shown("--reuse/--no-reuse", "reuse", False),
    _shown("--max-reuses", "max_reuses", 8),
    click.option("--max-live", "max_live", type=int, default=None, help="Cap on all live pods."),
    click.option("--max-warm", "max_warm", type=int, default=None, help="Global warm-pod budget."),
    _shown(
        "--create-s", "create_s", 5.0, "Create-to-ready of one pod (measure it: bench/scale.py)."
    ),
    _shown("--hit-s", "hit_s", 0.05),
    click.option("--create-rate", type=float, default=None, help="Pacer rate, creates/s."),
    _shown("--create-burst", "create_burst", 1),
    click.option(
        "--no-prefill", "prefill", flag_value=False, default=True, help="Pools start empty."
    ),
)


def _sweep(decl: str, metavar: str, help: str) -> Decorator:
    return click.option(decl, default=None, metavar=metavar, help=help)


def _policy_options(command: Command) -> Command:
    """Apply ``_POLICY_OPTIONS`` in the order they are listed (click reads bottom-up)."""
    for option in reversed(_POLICY_OPTIONS):
        command = option(command)
    return command


def register(group: click.Group) -> None:
    @group.command("replay")
    @click.argument("trace", type=click.Path(exists=True, dir_okay=False, path_type=Path))
    @click.option("--warm", "warm", multiple=True, metavar="IMAGE=SIZE", help="Pool per image.")
    @_policy_options
    @_sweep("--sweep-idle", "S,S,...", "Also evaluate these idle timeouts (a table).")
    @_sweep("--sweep-size", "N,N,...", "Also evaluate these --warm-default sizes (a table).")
    @click.option("--json", "as_json", is_flag=True, help="Print JSON only.")
    def replay(
        trace: Path,
        *,
        warm: tuple[str, ...],
        sweep_idle: str | None,
        sweep_size: str | None,
        as_json: bool,
        **policy: Any,
    ) -> None:
        """Predict warm-hit rate, acquisition wait, creates and idle pod-hours of a pool
        policy from TRACE (JSONL: time, job, image, role, duration), in virtual time."""
        from broker.replay import Policy, read_trace, simulate

        events = read_trace(trace)
        base = Policy(warm=_warm_map(warm), **policy)
        runs: list[tuple[str, Policy]] = [("policy", base)]
        runs.append(
            ("on-demand only", dataclasses.replace(base, warm={}, warm_default=0, reuse=False))
        )
        for idle in _floats(sweep_idle):
            runs.append((f"idle={idle:g}s", dataclasses.replace(base, idle_timeout_s=idle)))
        for size in _floats(sweep_size):
            runs.append((f"size={int(size)}", dataclasses.replace(base, warm_default=int(size))))
        results = {label: simulate(events, policy).to_dict() for label, policy in runs}
        doc = {
            "trace": str(trace),
            "requests": len(events),
            "span_s": events[-1].time if events else 0.0,
            "images": len({e.image for e in events}),
            "policy": dataclasses.asdict(base),
            "results": results,
        }
        if as_json:
            click.echo(json.dumps(doc, indent=2, default=str))
            return
        click.echo(
            f"{trace}: {doc['requests']} acquires over {doc['span_s']:.0f}s, {doc['images']} images"
        )
        for label, result in results.items():
            click.echo(_row(label, result))

    @group.group("trace")
    def trace_group() -> None:
        """Acquire/release traces (the replay format) from the broker's ledger."""

    @trace_group.command("export")
    @click.option("--job", default=None, help="Only this job.")
    @click.option("--since", type=click.DateTime(), default=None, help="UTC, acquired at or after.")
    @click.option("--until", type=click.DateTime(), default=None, help="UTC, acquired before.")
    @click.option(
        "-o",
        "--output",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help="Write here (default: stdout).",
    )
    @click.option("--absolute", is_flag=True, help="Keep epoch times (default: start at 0).")
    @click.pass_context
    def trace_export(
        ctx: click.Context,
        *,
        job: str | None,
        since: dt.datetime | None,
        until: dt.datetime | None,
        output: Path | None,
        absolute: bool,
    ) -> None:
        """Build a replay trace from the ledger's rows (request, hand-out and release times)."""
        from broker.cli.common import settings_of, tool_root
        from broker.replay.trace import TraceEvent, export_ledger, write_trace

        root = tool_root(settings_of(ctx), actor="trace-export")
        try:
            with root.sessions() as session:
                events = export_ledger(
                    session,
                    job=job,
                    since=since.replace(tzinfo=dt.UTC) if since else None,
                    until=until.replace(tzinfo=dt.UTC) if until else None,
                )
        finally:
            root.dispose()
        if events and not absolute:
            t0 = events[0].time
            events = [TraceEvent(e.time - t0, e.job, e.image, e.role, e.duration) for e in events]
        if output is None:
            count = write_trace(events, sys.stdout)
        else:
            output.parent.mkdir(parents=True, exist_ok=True)
            with output.open("w", encoding="utf-8") as fh:
                count = write_trace(events, fh)
        click.echo(f"{count} acquisitions exported", err=True)

# ruff: noqa: E501  (Markdown table rows read better on one line)
"""Performance report: runs the baseline benchmarks and writes Markdown, PNG plots and JSON.

Phases (each writes ``bench/out/<phase>.json``; ``report`` assembles whatever exists):

  replay   the simulator vs the real broker (local backend, warm pools) on a small trace
  execd    execd vs a raw bash pipe vs SWE-ReX (bench/execd_bench.py, imported)
  broker   warm hit vs cold acquire (bench/broker_bench.py --quick, same run's baselines)
  report   bench/out/report.md + *.png + report.json, also from scale.json / burst.json /
           cold_kwok.json
           written by bench/scale.py and bench/burst.py

    .venv/bin/python bench/report.py [--phases replay,execd,broker,report]

Local-stack phases use their own state dir (bench/out/state-local) and ports, so they never
touch a `sandman up` running on the default state dir.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import OUT, REPO, bench_env, load, save, stop_services, summary


def local_env() -> dict[str, str]:
    return bench_env(
        OUT / "state-local",
        pg_port=25432,
        redis_port=26379,
        backend="local",
        installation="sandman-bench-local",
    )


# -- replay: simulator vs the real broker ---------------------------------------------------


def phase_replay(args: argparse.Namespace) -> None:
    os.environ.update(local_env())
    from broker.client.sync import SandboxClient
    from broker.ledger.db import make_engine, make_session_factory
    from broker.local.stack import Stack
    from broker.replay import Policy, write_trace
    from broker.replay.validate import drive, synthetic_trace
    from broker.settings import Settings

    settings = Settings.from_env()
    events = synthetic_trace(n=args.replay_n, span_s=args.replay_span)
    with (OUT / "replay-trace.jsonl").open("w") as fh:
        write_trace(events, fh)
    images = sorted({e.image for e in events})
    policy = Policy(warm={images[0]: 2, images[1]: 1}, idle_timeout_s=args.replay_idle)
    stack = Stack(settings)
    print("replay: starting a local stack ...", flush=True)
    stack.start(web=False, echo=False)
    engine = make_engine(stack.database_url)
    client = SandboxClient(stack.redis_url, owner="replay-bench", heartbeat_s=3600)
    try:
        job = f"replay-{int(time.time())}"
        doc = drive(
            client,
            make_session_factory(engine),
            events,
            job=job,
            policy=policy,
            speed=args.replay_speed,
        )
        doc["trace"] = str(OUT / "replay-trace.jsonl")
        m, p = doc["measured"], doc["predicted"]
        print(
            f"replay: measured hit {m['hit_rate']:.3f} creates {m['creates']}  |  predicted "
            f"hit {p['hit_rate']:.3f} creates {p['creates']}  (create_s "
            f"{doc['policy']['create_s']:.2f}s, errors {len(m['errors'])})",
            flush=True,
        )
        save("replay", doc)
        time.sleep(3)
    finally:
        client.close()
        engine.dispose()
        stack.stop()
        stop_services(settings)


# -- execd vs raw pipe vs SWE-ReX --------------------------------------------------------------


def phase_execd(args: argparse.Namespace) -> None:
    import shutil
    import tempfile

    from bench import execd_bench as eb

    tmp = Path(tempfile.mkdtemp(prefix="report-execd-"))
    d = eb.Execd(sys.executable, tmp)
    try:
        ex = eb.bench_execd(d, args.execd_n)
        raw = eb.bench_raw_pipe(args.execd_n)
        sw, why = eb.bench_swerex(args.swerex_n)
    finally:
        d.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    doc = {
        "n": args.execd_n,
        "load": os.getloadavg()[0],
        "execd_s": ex,
        "raw_pipe_s": raw,
        "swerex_s": sw or [],
        "swerex_note": why,
        "execd": summary(ex),
        "raw_pipe": summary(raw),
        "swerex": summary(sw or []),
    }
    print(
        f"execd p50 {doc['execd']['p50'] * 1e3:.3f} ms, raw pipe {doc['raw_pipe']['p50'] * 1e3:.3f}"
        f" ms, swerex {doc['swerex']['p50'] * 1e3:.3f} ms ({why or 'ok'})",
        flush=True,
    )
    save("execd", doc)


# -- warm vs cold via broker_bench ------------------------------------------------------------

_LINE = re.compile(
    r"^(?P<name>.+?)\s+n=(?P<n>\d+)\s+p50=\s*(?P<p50>[\d.]+) ms p99=\s*(?P<p99>[\d.]+) ms"
)


def phase_broker(args: argparse.Namespace) -> None:
    cmd = [
        sys.executable,
        str(REPO / "bench" / "broker_bench.py"),
        "--quick",
        "--phases",
        "warm,cold",
    ]
    started = time.monotonic()
    proc = subprocess.run(
        cmd, env=local_env(), capture_output=True, text=True, timeout=1800, check=False, cwd=REPO
    )
    print(proc.stdout[-3000:], proc.stderr[-1500:] if proc.returncode else "", flush=True)
    rows = {}
    for line in proc.stdout.splitlines():
        m = _LINE.match(line)
        if m:
            rows[m["name"].strip()] = {
                "n": int(m["n"]),
                "p50_s": float(m["p50"]) / 1e3,
                "p99_s": float(m["p99"]) / 1e3,
                "line": line.strip(),
            }
    save(
        "broker",
        {
            "returncode": proc.returncode,
            "rows": rows,
            "stdout": proc.stdout,
            "wall_s": time.monotonic() - started,
        },
    )
    from broker.settings import Settings

    stop_services(Settings.from_env(local_env()))


# -- the report --------------------------------------------------------------------------------


def _ms(v: float | None) -> str:
    return "n/a" if v is None or v != v else f"{v * 1e3:.2f} ms"


def _s(v: float | None) -> str:
    return "n/a" if v is None or v != v else f"{v:.3f} s"


def _plots(scale: dict | None, burst: dict | None, execd: dict | None) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made: list[str] = []

    def done(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(OUT / name, dpi=90)
        plt.close(fig)
        made.append(name)

    if scale and scale.get("hist_create_to_ready"):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        axes[0].hist(scale["hist_create_to_ready"], bins=60, color="#3b7dd8")
        axes[0].set(title="create-to-Ready (kwok, simulated readiness)", xlabel="s", ylabel="pods")
        axes[1].hist(scale["hist_acquire"], bins=60, color="#d8793b")
        axes[1].set(title="queue-inclusive acquisition", xlabel="s")
        done(fig, "scale_latency_hist.png")
    if scale and scale.get("live_series"):
        fig, ax = plt.subplots(figsize=(11, 4))
        t, live = zip(*scale["live_series"], strict=True)
        ax.plot(t, live, color="#3b7dd8", label="sandboxes held")
        ax.axhline(11858, color="grey", ls="--", label="paper peak 11,858")
        ax.set(xlabel="s since ramp start", ylabel="held")
        ax2 = ax.twinx()
        if scale.get("create_rate_series"):
            rt, rate = zip(*scale["create_rate_series"], strict=True)
            ax2.plot(rt, rate, color="#d8793b", alpha=0.7, label="creates/s (5 s buckets)")
        ax2.axhline(scale["pacer_rate"], color="#d8793b", ls=":", label="pacer setting")
        ax2.set(ylabel="creates/s")
        fig.legend(loc="upper left")
        done(fig, "scale_ramp.png")
    if burst and burst.get("create_rate_series"):
        fig, ax = plt.subplots(figsize=(11, 3.5))
        bt, br = zip(*burst["create_rate_series"], strict=True)
        ax.bar(bt, br, width=0.9, color="#3b7dd8", label="creates started per second")
        ax.axhline(burst["configured_rate"], color="red", ls="--", label="pacer rate")
        ax.set(
            xlabel="s since the burst was submitted",
            ylabel="creates/s",
            title=f"{burst['args']['n']} acquires submitted in {burst['submit_s']:.2f}s",
        )
        ax.legend()
        done(fig, "burst_rate.png")
    if execd:
        fig, ax = plt.subplots(figsize=(11, 3.5))
        import numpy as np

        series = [
            ("raw pipe", execd["raw_pipe_s"]),
            ("execd", execd["execd_s"]),
            ("SWE-ReX", execd["swerex_s"]),
        ]
        allv = [v for _, vs in series for v in vs if v > 0]
        bins = np.logspace(np.log10(min(allv)), np.log10(max(allv)), 80)
        for name, vs in series:
            if vs:
                ax.hist(vs, bins=bins, alpha=0.6, label=name)
        ax.set_xscale("log")
        ax.set(xlabel="echo hi round trip (s, log)", ylabel="calls")
        ax.legend()
        done(fig, "execd_hist.png")
    return made


def _table(*columns: str) -> list[str]:
    """The head of a Markdown table."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def _section(title: str, *columns: str, intro: str = "") -> list[str]:
    """A heading, an optional paragraph, and the head of the section's table."""
    return [f"## {title}", "", *([intro, ""] if intro else []), *_table(*columns)]


def _lat(d: dict | None) -> str:
    if not d:
        return "n/a"
    return f"p50 {_s(d.get('p50'))}, p90 {_s(d.get('p90'))}, p99 {_s(d.get('p99'))}"


def phase_report(args: argparse.Namespace) -> None:
    scale, burst, replay = load("scale"), load("burst"), load("replay")
    execd, broker = load("execd"), load("broker")
    made = _plots(scale, burst, execd)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    ).stdout.strip()
    md = [
        "# Sandman broker: performance report",
        "",
        f"Generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} at {commit} on "
        f"{os.cpu_count()} CPUs (load average when rendered: {os.getloadavg()[0]:.1f}). "
        "Every figure is compared with a baseline measured in the same run. Raw figures: "
        "`report.json`.",
        "",
    ]
    figures: dict[str, Any] = {}
    if scale:
        bare = scale.get("bare_api") or {}
        usage = scale.get("usage_ramp") or {}
        leaks = scale.get("leaks_after") or {}
        ratio = scale["achieved_create_rate"] / bare["create_rate"] if bare else math.nan
        md += [
            *_section(
                "Scale run (kwok nodes, full stack, **simulated readiness**)",
                "figure",
                "value",
                "baseline / reference",
            ),
            f"| sandboxes held concurrently | **{scale['held_peak']}** | paper: 11,858 |",
            f"| acquire errors | {scale.get('error_count', 'see note')} | paper: 83 timeouts |",
            f"| target reached | {'yes' if scale['held_peak'] >= scale.get('args', {}).get('target', 12000) else '**no**'} | target {scale.get('args', {}).get('target', 12000)} |",
            f"| create-to-Ready | {_lat(scale['create_to_ready_s'])} | paper: 5-7 s median |",
            f"| queue-inclusive acquisition (ledger) | {_lat(scale['acquire_latency_s'])} | |",
            f"| queue-inclusive acquisition (client) | {_lat(scale.get('client_acquire_s'))} | |",
            f"| achieved create rate | {scale['achieved_create_rate']:.2f}/s | pacer {scale['pacer_rate']:g}/s "
            f"({(scale['achieved_create_rate'] / scale['pacer_rate'] - 1) * 100:+.1f}%) |",
            f"| bare API create rate (plain client, 32 threads) | {bare.get('create_rate', math.nan):.1f}/s | "
            f"broker/bare = {ratio:.2f} |",
            f"| ramp wall time | {scale['ramp_wall_s']:.0f} s | |",
        ]
        for name, value in (scale.get("usage_ramp_samples") or {}).items():
            md.append(f"| {name} (5-s samples over the ramp) | {value:.1f} | |")
        for name, u in (scale.get("usage_cumulative") or {}).items():
            if isinstance(u, dict) and "cpu_s" in u:
                md.append(
                    f"| {name}: CPU since start / peak RSS | {u['cpu_s']:.0f} CPU-s | "
                    f"{u['peak_rss_mb']:.0f} MiB |"
                )
        for name, u in usage.items():
            md.append(
                f"| {name} CPU over the ramp | {u['avg_cores']:.2f} cores avg "
                f"({u['cpu_s']:.0f} CPU-s) | peak RSS {u['peak_rss_mb']:.0f} MiB |"
            )
        gc = scale.get("gc_full_scale") or {}
        md += [
            f"| one GC pass at full scale | {gc.get('duration_s', math.nan):.2f} s | "
            f"{gc.get('pods_seen')} pods, {gc.get('live_rows')} rows, {gc.get('actions')} actions |",
            f"| release of all | {scale.get('release_wall_s', math.nan):.0f} s "
            f"({scale.get('release_rate', math.nan):.1f}/s) | |",
            f"| leaks after teardown | pods left {leaks.get('pods_left')}, open leaks "
            f"{leaks.get('open_leaks')}, live rows {leaks.get('live_rows')} | must be 0 |",
        ]
        led = scale.get("ledger") or {}
        if led:
            md.append(
                f"| ledger size | sandboxes {led['sandboxes']['rows']} rows "
                f"{led['sandboxes']['bytes'] / 2**20:.1f} MiB, events {led['events']['rows']} rows "
                f"{led['events']['bytes'] / 2**20:.1f} MiB | database "
                f"{led['database_bytes'] / 2**20:.1f} MiB |"
            )
        md += ["", f"API outcomes: `{json.dumps(scale.get('api_outcomes'))}`", ""]
        if scale.get("args", {}).get("note"):
            md += [f"Run notes: {scale['args']['note']}.", ""]
        figures["scale"] = {k: v for k, v in scale.items() if not k.startswith("hist_")}
    if burst:
        md += [
            *_section("Burst run", "figure", "value", "reference"),
            f"| acquires submitted | {burst['args']['n']} in {burst['submit_s']:.2f} s | |",
            f"| delivered / lost / errors | {burst['delivered']} / {burst['lost']} / "
            f"{burst['errors']} | lost must be 0 |",
            f"| API errors (non-201 create attempts) | {burst['api_errors']} | must be 0 |",
            f"| achieved create rate | {burst['achieved_rate']:.2f}/s | configured "
            f"{burst['configured_rate']:g}/s burst {burst['args']['burst']} |",
            f"| max creates in any 1 s window | {burst['max_in_1s']} | limit rate+burst = "
            f"{burst['limit_1s']:g} |",
            f"| worst excess over rate*t+burst | {burst['worst_excess']:+.2f} | <= 0 (ledger "
            "stamps include DB commit jitter) |",
            f"| queue-inclusive acquisition | {_lat(burst['acquire_latency_s'])} | spread "
            f"{burst['span_s']:.1f} s by design |",
            f"| leaks after teardown | {json.dumps(burst.get('leaks_after', {}).get('pods_left'))} "
            f"pods, {burst.get('leaks_after', {}).get('open_leaks')} open leaks | 0 |",
            "",
        ]
        figures["burst"] = burst
    if replay:
        m, p = replay["measured"], replay["predicted"]
        md += [
            *_section(
                "Replay simulator vs the real broker",
                "figure",
                "predicted",
                "measured",
                intro=f"Trace `{Path(replay['trace']).name}` ({m['requests']} acquires), pools "
                f"`{replay['policy']['warm']}`, idle timeout {replay['policy']['idle_timeout_s']:g} s, "
                f"replayed in real time against the local backend; the simulator uses the run's "
                f"own create-to-ready p50 ({replay['policy']['create_s']:.2f} s).",
            ),
            f"| warm-hit rate | {p['hit_rate']:.3f} | {m['hit_rate']:.3f} |",
            f"| creates | {p['creates']} | {m['creates']} |",
            f"| acquisition wait p50 | {_s(p['wait_p50_s'])} | {_s(m['wait_p50_s'])} |",
            f"| acquisition wait p90 | {_s(p['wait_p90_s'])} | {_s(m['wait_p90_s'])} |",
            f"| acquisition wait mean | {_s(p['wait_mean_s'])} | {_s(m['wait_mean_s'])} |",
            "",
        ]
        figures["replay"] = replay
        from broker.replay import Policy, read_trace, simulate

        trace = read_trace(replay["trace"])
        base = Policy(**{**replay["policy"], "warm": dict(replay["policy"]["warm"])})
        md += [
            "Simulator-only sweep on the same trace (what an operator would do next):",
            "",
            *_table("policy", "hit rate", "wait mean", "creates", "idle pod-h", "total pod-h"),
        ]
        sweep = {}
        variants = [("as measured", {}), ("no pool", {"warm": {}})]
        variants += [(f"idle {t:g}s", {"idle_timeout_s": t}) for t in (5, 60, 300)]
        variants += [("idle 5s, refill=demand", {"idle_timeout_s": 5, "refill": "demand"})]
        variants += [("reuse on", {"reuse": True})]
        for label, change in variants:
            r = simulate(trace, Policy(**{**base.__dict__, **change})).to_dict()
            sweep[label] = r
            md.append(
                f"| {label} | {r['hit_rate']:.3f} | {_s(r['wait_mean_s'])} | {r['creates']} | "
                f"{r['idle_pod_hours']:.4f} | {r['total_pod_hours']:.4f} |"
            )
        md.append("")
        figures["replay_sweep"] = sweep
    if execd:
        e, r, w = execd["execd"], execd["raw_pipe"], execd["swerex"]
        md += [
            *_section(
                "execd vs raw pipe vs SWE-ReX (`echo hi` round trip)",
                "path",
                "p50",
                "p90",
                "p99",
                "vs raw pipe (p50)",
            ),
            f"| raw bash pipe (floor) | {_ms(r['p50'])} | {_ms(r['p90'])} | {_ms(r['p99'])} | 1x |",
            f"| execd (HTTP keep-alive) | {_ms(e['p50'])} | {_ms(e['p90'])} | {_ms(e['p99'])} | "
            f"{e['p50'] / r['p50']:.1f}x |",
            f"| SWE-ReX swerex-remote | {_ms(w['p50'])} | {_ms(w['p90'])} | {_ms(w['p99'])} | "
            f"{w['p50'] / r['p50']:.1f}x (= {w['p50'] / e['p50']:.0f}x execd) |"
            if w["n"]
            else f"| SWE-ReX | not measured: {execd['swerex_note']} | | | |",
            "",
        ]
        figures["execd"] = {k: v for k, v in execd.items() if not k.endswith("_s")}
    if broker:
        md += [
            *_section(
                "Warm hit vs cold acquire (bench/broker_bench.py --quick, local backend)",
                "measurement",
                "n",
                "p50",
                "p99",
            ),
        ]
        for name, row in broker["rows"].items():
            md.append(f"| {name} | {row['n']} | {_ms(row['p50_s'])} | {_ms(row['p99_s'])} |")
        md.append("")
        figures["broker"] = broker["rows"]
    for name, how in (
        ("cold_kwok", "all processes share every CPU"),
        ("cold_kwok_isolated", "--isolate-cpus: control plane on one CPU, broker on the other"),
    ):
        cold = load(name)
        if not cold:
            continue
        md += [
            *_section(
                "Cold acquires on kwok: broker overhead vs API server and node "
                f"(bench/cold_kwok.py, **simulated readiness**, pacing off; {how})",
                "concurrency",
                "trainer acquire p50 / p99",
                "API+node p50 / p99",
                "broker overhead p50 / p99",
                "baseline: bare POST->Ready p50 / p99",
            ),
        ]
        for key in sorted((k for k in cold if k.startswith("c")), key=lambda k: int(k[1:])):
            row = cold[key]
            cells = [
                f"{_ms(row[f]['p50'])} / {_ms(row[f]['p99'])}"
                for f in (
                    "acquire_s",
                    "api_and_node_s",
                    "broker_overhead_s",
                    "baseline_bare_create_to_ready_s",
                )
            ]
            md.append(f"| {key[1:]} | " + " | ".join(cells) + " |")
        md.append("")
        figures[name] = cold
    md += ["## Plots", ""] + [f"![{m}]({m})" for m in made] + [""]
    (OUT / "report.md").write_text("\n".join(md))
    (OUT / "report.json").write_text(json.dumps(figures, indent=1, default=str))
    print(f"wrote {OUT / 'report.md'} and {len(made)} plots", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--phases", default="replay,execd,broker,report")
    parser.add_argument("--replay-n", type=int, default=60)
    parser.add_argument("--replay-span", type=float, default=120.0)
    parser.add_argument("--replay-speed", type=float, default=1.0)
    parser.add_argument("--replay-idle", type=float, default=20.0)
    parser.add_argument("--execd-n", type=int, default=1000)
    parser.add_argument("--swerex-n", type=int, default=100)
    args = parser.parse_args()
    for phase in args.phases.split(","):
        print(f"== {phase}", flush=True)
        globals()[f"phase_{phase}"](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

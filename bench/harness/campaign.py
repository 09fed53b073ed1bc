"""Randomised ownership trials against a real API server, through the fault proxy.

Each trial is one request: intent, create, release, in a forked child process that may be
SIGKILLed at a named failpoint (a worker crash) while the proxy injects API faults. A
killed trial is redelivered to a fresh child with the same request id, as Celery does with
``acks_late``. At the end one GC pass runs and the invariants are counted:

  unowned pods after one GC pass   pods of ours with no live row, or rows with no pod: 0
  sentinel pods deleted            foreign / unknown-nonce pods we must never touch:   0
  requests without an answer       every request ends with a lease or a typed error:   0
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from bench.harness.faultproxy import FaultProxy, Rule
from bench.kwok import ensure_kwok_job, plant_sentinels
from broker.backends.kube.api import Kube, load_api_client
from broker.backends.kube.backend import KubeBackend
from broker.errors import SandmanError
from broker.ledger.db import make_engine, make_session_factory
from broker.ledger.models import Event, Sandbox
from broker.ledger.states import State
from broker.ownership.gc import RECENT_S, run_gc
from broker.ownership.provider import Provider
from broker.settings import Settings
from broker.wire.request import AcquireRequest

FAILPOINTS = (
    "after-intent",
    "after-creating-commit",
    "after-create-sent",
    "before-ready-commit",
    "after-releasing-commit",
    "after-delete-sent",
)
PROXY_FAULTS = (
    Rule("error_after", "POST", r"/pods$", probability=0.06, times=None),
    Rule("reset_after", "POST", r"/pods$", probability=0.06, times=None),
    Rule("reset_before", "POST", r"/pods$", probability=0.04, times=None),
    Rule("throttle", "POST", r"/pods$", probability=0.04, times=None, retry_after=1),
    Rule("delay", "POST", r"/pods$", probability=0.03, times=None, seconds=1.5),
    Rule("error_after", "DELETE", r"/pods/[^/]+$", probability=0.06, times=None),
    Rule("reset_after", "DELETE", r"/pods/[^/]+$", probability=0.05, times=None),
    Rule("reset_before", "GET", r"/pods/[^/]+$", probability=0.02, times=None),
)


@dataclass
class CampaignResult:
    trials: int = 0
    pods_created: int = 0
    answered: int = 0
    answers: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    kills: Counter[str] = field(default_factory=Counter)
    proxy_faults: dict[str, int] = field(default_factory=dict)
    unowned_after_gc: int = 0
    dangling_after_gc: int = 0
    pods_left: int = 0
    sentinels_deleted: int = 0
    duration_s: float = 0.0
    gc_duration_s: float = 0.0

    @property
    def unanswered(self) -> int:
        return self.trials - self.answered

    @property
    def crashes(self) -> int:
        return self.answers.get("crash", 0)

    @property
    def ok(self) -> bool:
        return not (
            self.unanswered
            or self.crashes
            or self.unowned_after_gc
            or self.dangling_after_gc
            or self.sentinels_deleted
            or self.pods_left
        )

    def summary(self) -> str:
        return "\n".join(
            [
                f"trials:                          {self.trials}",
                f"pods created:                    {self.pods_created}",
                f"answers:                         {dict(self.answers)}",
                f"typed errors returned:           {dict(self.errors)}",
                f"worker kills by failpoint:       {dict(self.kills)}",
                f"API faults injected by kind:     {self.proxy_faults}",
                f"unowned pods after one GC pass:  {self.unowned_after_gc}",
                f"dangling rows after one GC pass: {self.dangling_after_gc}",
                f"our pods left after teardown:    {self.pods_left}",
                f"sentinel pods deleted:           {self.sentinels_deleted}",
                f"requests without an answer:      {self.unanswered}",
                f"untyped crashes in a trial:      {self.crashes}",
                f"wall time: {self.duration_s:.1f}s  (final GC pass {self.gc_duration_s:.2f}s)",
                "RESULT: " + ("OK" if self.ok else "INVARIANT VIOLATED"),
            ]
        )


def _trial_child(
    settings: Settings, database_url: str, request_id: str, failpoint: str | None, out: Any
) -> None:
    """Runs in a forked child: one request end to end; SIGKILLs itself at ``failpoint``."""

    def crash(name: str) -> None:
        if name == failpoint:
            os.kill(os.getpid(), signal.SIGKILL)

    engine = make_engine(database_url, pool_size=1, max_overflow=1)
    provider = Provider(
        settings,
        make_session_factory(engine),
        KubeBackend.from_settings(settings),
        actor=f"trial-{os.getpid()}",
        failpoint=crash,
    )
    try:
        sandbox_id, token = provider.intent(
            AcquireRequest(
                job="campaign",
                image="localhost/kwok:1",
                cpu_m=10,
                memory_b=16 << 20,
                request_id=request_id,
            )
        )
        answer = "lease"
        try:
            provider.create(sandbox_id, token)
        except SandmanError as exc:
            answer = f"error:{type(exc).__name__}"
        provider.release(sandbox_id, actor="trial")
        out.send(answer)
    except SandmanError as exc:
        out.send(f"error:{type(exc).__name__}")
    except Exception as exc:  # an untyped failure is a bug: counted as a crash
        out.send(f"crash:{type(exc).__name__}: {exc}")
    finally:
        engine.dispose()


def _run_trial(
    ctx: Any,
    *,
    settings: Settings,
    database_url: str,
    request_id: str,
    failpoint: str | None,
    timeout_s: float,
) -> tuple[str | None, bool]:
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=_trial_child, args=(settings, database_url, request_id, failpoint, send)
    )
    proc.start()
    send.close()
    answer: str | None = None
    if recv.poll(timeout_s):
        try:
            answer = recv.recv()
        except EOFError:  # the child died (SIGKILL at its failpoint) before answering
            answer = None
    proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join()
    killed = proc.exitcode == -signal.SIGKILL
    return answer, killed


def run_campaign(
    *,
    kubeconfig: str,
    database_url: str,
    trials: int = 1000,
    concurrency: int = 4,
    seed: int = 1,
    sentinels: int = 6,
    state_dir: Path,
    progress: Callable[[int, int], None] | None = None,
) -> CampaignResult:
    rng = random.Random(seed)
    result = CampaignResult()
    started = time.monotonic()
    installation = f"campaign-{seed}-{os.getpid()}"
    namespace = f"sandman-campaign-{os.getpid()}"
    admin = Kube(load_api_client(kubeconfig))
    admin.ensure_namespace(namespace)
    proxy = FaultProxy.from_kubeconfig(kubeconfig, seed=seed).start()
    proxy_kubeconfig = str(proxy.write_kubeconfig(state_dir / "faultproxy.kubeconfig"))
    settings = Settings(
        state_dir=state_dir,
        backend="kubernetes",
        kubeconfig=proxy_kubeconfig,
        namespace=namespace,
        installation_id=installation,
        create_lease_margin_s=2.0,
    )
    engine = make_engine(database_url, pool_size=2)
    sessions = make_session_factory(engine)
    with sessions.begin() as s:
        ensure_kwok_job(s, "campaign", readiness_budget_s=20.0, lease_s=120.0)
    sentinel_names: list[str] = []
    try:
        sentinel_names[:] = plant_sentinels(admin, namespace, installation, sentinels)
        for rule in PROXY_FAULTS:
            proxy.add(Rule(**{**rule.__dict__, "hits": 0}))
        ctx = multiprocessing.get_context("fork")
        engine.dispose()  # no pooled connection crosses a fork
        from concurrent.futures import ThreadPoolExecutor

        planned = [rng.choice(FAILPOINTS) if rng.random() < 0.3 else None for _ in range(trials)]

        def one(i: int) -> tuple[str | None, list[str]]:
            failpoint = planned[i]
            kills: list[str] = []
            request_id = f"trial-{i}"
            for _attempt in range(4):
                answer, killed = _run_trial(
                    ctx,
                    settings=settings,
                    database_url=database_url,
                    request_id=request_id,
                    failpoint=failpoint,
                    timeout_s=90,
                )
                if killed and failpoint:
                    kills.append(failpoint)
                if answer is not None:
                    return answer, kills
                failpoint = None  # redelivery runs to completion
            return None, kills

        done = 0
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            for answer, kills in pool.map(one, range(trials)):
                done += 1
                result.trials += 1
                result.kills.update(kills)
                if answer is not None:
                    result.answered += 1
                    result.answers[answer.split(":")[0]] += 1
                    if answer.startswith(("error", "crash")):
                        result.errors[answer] += 1
                if progress:
                    progress(done, trials)
        proxy.clear()
        result.proxy_faults = dict(proxy.counts)
        # Recovery: let creating leases and the GC's race window pass, then ONE pass.
        time.sleep(max(settings.create_lease_margin_s, RECENT_S) + 1)
        gc_provider = Provider(settings, sessions, KubeBackend.from_settings(settings), actor="gc")
        report = run_gc(gc_provider)
        result.gc_duration_s = report.duration_s
        after = run_gc(gc_provider, dry_run=True)
        result.unowned_after_gc = len([p for p in after.unowned_pods if p not in sentinel_names])
        dangling = set(after.dangling_rows) | {
            a["sandbox"] for a in after.actions if a["why"] != "idle"
        }
        backend = KubeBackend(admin, installation=installation)
        result.pods_left = len(
            [
                p
                for p in backend.list_installation(namespace, installation)
                if p.name not in sentinel_names
            ]
        )
        present = {p.name for p in backend.list_all_labelled(namespace)}
        result.sentinels_deleted = sum(1 for n in sentinel_names if n not in present)
        with sessions() as s:
            result.pods_created = int(
                s.scalar(
                    select(func.count(func.distinct(Event.pod_name))).where(
                        Event.sandbox_id.in_(
                            select(Sandbox.id).where(Sandbox.installation == installation)
                        ),
                        Event.kind == "api",
                        Event.action.in_(["create", "adopt"]),
                        Event.outcome.in_(["created", "nonce-match"]),
                    )
                )
                or 0
            )
            dangling |= set(
                s.scalars(
                    select(Sandbox.id).where(
                        Sandbox.installation == installation,
                        Sandbox.state != State.DELETED,
                        Sandbox.state != State.FAILED,
                    )
                )
            )
        result.dangling_after_gc = len(dangling)
        for name in sentinel_names:
            from contextlib import suppress

            with suppress(SandmanError):
                admin.delete_pod(namespace, name, uid=None)
    finally:
        proxy.stop()
        engine.dispose()
        admin.delete_namespace(namespace)
    result.duration_s = time.monotonic() - started
    return result


def main_json(result: CampaignResult) -> str:
    return json.dumps(
        {
            **{k: getattr(result, k) for k in result.__dataclass_fields__},
            "unanswered": result.unanswered,
            "ok": result.ok,
        },
        default=dict,
        indent=2,
    )

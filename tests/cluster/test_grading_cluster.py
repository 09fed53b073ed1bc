"""Grading through the real broker on the local cluster, with the SWE task image.

A Celery worker with the Kubernetes backend serves acquires for a job whose node
selector targets the real node, so rollout and grading pods run
``localhost/sandman-swe-task:v1`` (repository at /repo, at the task's base commit).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker.client.sync import Sandbox, SandboxClient
from broker.grading import GradeConfig, Grader, GradingClient, Verdict, load_task
from broker.grading.api import broker_acquire
from broker.grading.seam import SandboxRequest
from broker.ledger import store
from tests.cluster.conftest import REAL_NODE_SELECTOR, SWE_TASK_IMAGE, default_sa_exists
from tests.support.wait import wait_until

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
SWE = REPO / "deploy" / "images" / "swe-task"
SPECS = SWE / "specs"
JOB = "grading-real"


STACK_DBS = range(15, 9, -1)  # Redis databases the grading stacks may claim
OWNER_KEY = "sandman-test:stack-owner"
# Atomically: take the database if its owner is still the one we saw (nobody, or a
# dead process), flushing whatever that owner left, and name ourselves its owner.
_TAKE = """
local owner = redis.call('GET', KEYS[1]) or ''
if owner ~= ARGV[1] then return 0 end
redis.call('FLUSHDB')
redis.call('SET', KEYS[1], ARGV[2])
return 1
"""


def _owner_gone(owner: str) -> bool:
    """An owner is ``<pid>``: gone when no such process runs here (a crashed session)."""
    try:
        return not Path(f"/proc/{int(owner)}").exists()
    except ValueError:
        return True


def claim_redis_db(redis_url: str) -> str:
    """The URL of a Redis database (10-15) owned by this test process.

    A database is free unless its owner key names a live process: a session killed
    before its teardown must not leave a database taken for every later run on this
    state dir. Keys without an owner are such leftovers (from before owners existed);
    taking a database flushes it.
    """
    import redis as redis_lib

    base = redis_url.rsplit("/", 1)[0]
    me = str(os.getpid())
    for n in STACK_DBS:
        db = redis_lib.Redis.from_url(f"{base}/{n}")
        try:
            raw = db.get(OWNER_KEY)
            owner = raw.decode() if raw else ""
            if owner == me or (owner and not _owner_gone(owner)):
                continue  # another live stack's (or one of ours still up)
            if db.eval(_TAKE, 1, OWNER_KEY, owner, me):
                return f"{base}/{n}"
        finally:
            db.close()
    raise AssertionError(f"no free Redis database for the grading stack in {list(STACK_DBS)}")


@pytest.fixture(scope="module")
def stack(  # type: ignore[no-untyped-def]
    kubeconfig_path, core_v1, database_url, redis_url, tmp_path_factory
) -> Iterator[dict[str, Any]]:
    """A namespace, the job row and one Celery worker with the Kubernetes backend."""
    import redis as redis_lib
    from kubernetes import client as k8s

    from broker.ledger.db import make_engine, make_session_factory

    namespace = f"lc-grading-{secrets.token_hex(3)}"
    core_v1.create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=namespace)))
    wait_until(
        lambda: default_sa_exists(core_v1, namespace),
        60,
        what=f"serviceaccount {namespace}/default",
    )
    # A Redis database of its own (other sessions may share the embedded Redis), so no
    # other worker can take this stack's messages.
    url = claim_redis_db(redis_url)
    engine = make_engine(database_url)
    with make_session_factory(engine).begin() as s:
        store.ensure_job(s, JOB, node_selector=REAL_NODE_SELECTOR, readiness_budget_s=180.0)
    engine.dispose()
    state = tmp_path_factory.mktemp("grading-stack")
    env = {
        **os.environ,
        "SANDMAN_BACKEND": "kubernetes",
        "SANDMAN_KUBECONFIG": kubeconfig_path,
        "SANDMAN_NAMESPACE": namespace,
        "SANDMAN_DATABASE_URL": database_url,
        "SANDMAN_REDIS_URL": url,
        "SANDMAN_STATE_DIR": str(state),
        "SANDMAN_INSTALLATION_ID": f"test-grading-{secrets.token_hex(3)}",
        "PYTHONPATH": str(REPO),
    }
    log = (state / "worker.log").open("wb")
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "workers.app", "worker", "-Q",
         "acquire,release,pool", "-P", "threads", "-c", "16", "--loglevel", "INFO",
         "--without-heartbeat", "--without-gossip", "--without-mingle"],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    client = SandboxClient(url, owner="grading-cluster-tests")
    try:
        yield {"client": client, "namespace": namespace, "env": env, "log": state / "worker.log"}
    finally:
        client.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
        log.close()
        with contextlib.suppress(Exception):
            core_v1.delete_namespace(namespace, grace_period_seconds=0)
        # Free the Redis database for the next stack: three modules build one each
        # (this one, test_harness_cluster, test_inspect_conformance_cluster).
        redis_lib.Redis.from_url(url).flushdb()


CFG = GradeConfig(
    max_attempts=2, retry_backoff_s=0.5, memory="512Mi", cpu=0.5, acquire_timeout_s=180
)


def grader(stack: dict[str, Any], config: GradeConfig = CFG) -> GradingClient:
    return GradingClient(stack["client"], job=JOB, config=config)


def test_reference_empty_wrong_and_test_edits(stack: dict[str, Any]) -> None:
    task = load_task(SWE / "task.json")
    assert task.image == SWE_TASK_IMAGE
    g = grader(stack)
    started = time.monotonic()
    ref = g.grade(task, task.reference_patch)
    latency = time.monotonic() - started
    assert ref.verdict is Verdict.RESOLVED, (ref.reason, ref.attempts, ref.output_tail)
    assert ref.probe is not None
    print(f"\ngrading latency {latency:.2f}s; attempt durations {ref.attempts[0].durations}")
    print("probe:", [c["detail"] for c in ref.probe["checks"]])
    assert g.grade(task, b"").verdict is Verdict.UNRESOLVED
    assert g.grade(task, (SPECS / "wrong.patch").read_bytes()).verdict is Verdict.UNRESOLVED
    edit = g.grade(task, (SPECS / "tests-edit.patch").read_bytes())
    assert edit.verdict is Verdict.UNRESOLVED and "tests/test_stats.py" in edit.dropped_files


def test_rollout_patch_is_extracted_and_graded_elsewhere(stack: dict[str, Any]) -> None:
    task = load_task(SPECS / "swebench-style.json")
    client: SandboxClient = stack["client"]
    g = grader(stack)
    with client.acquire(
        image=task.image, job=JOB, cpu=0.5, memory="512Mi", workdir=task.repo_path, timeout=300
    ) as rollout:
        rollout.write_file("/tmp/fix.patch", task.reference_patch or b"")
        out = rollout.exec(
            "cd /repo && git apply /tmp/fix.patch && sed -i 's/2.5)/3)/' tests/test_stats.py"
            " && git -c user.name=a -c user.email=a@b commit -qam agent && echo x > NEW.txt",
            timeout=60,
        )
        assert out.exit_code == 0, out.stderr
        extracted = g.extract(rollout, task)
        result = g.grade(task, extracted)
        assert rollout.id not in {a.sandbox_id for a in result.attempts}
    assert set(extracted.files) == {"statlib/stats.py", "NEW.txt"}
    assert extracted.base_tree == task.base_tree
    assert result.verdict is Verdict.RESOLVED, (result.reason, result.output_tail)
    statuses = {c["field"]: c["status"] for c in (result.probe or {})["checks"]}
    assert statuses["pythonhashseed"] == statuses["tz"] == statuses["locale"] == "ok"


def test_declared_conditions_are_checked_against_the_pod(stack: dict[str, Any]) -> None:
    base = load_task(SWE / "task.json")
    g = grader(stack, dataclasses.replace(CFG, max_attempts=1))
    matching = dataclasses.replace(
        base,
        conditions=dataclasses.replace(base.conditions, memory_b=512 << 20, cpus=0.5),
    )
    ok = g.grade(matching, base.reference_patch)
    assert ok.verdict is Verdict.RESOLVED, (ok.reason, ok.probe)
    refused = g.grade(load_task(SPECS / "egress-allowed.json"), base.reference_patch)
    assert refused.verdict is Verdict.INFRA_ERROR
    assert refused.infra_kind == "probe_contradiction"
    assert refused.probe is not None and "egress" in refused.probe["contradictions"]
    print("\nrefused:", [c["detail"] for c in refused.probe["checks"]])


def test_deleted_grading_pod_is_retried_and_labelled(stack: dict[str, Any], core_v1: Any) -> None:
    task = load_task(SWE / "task.json")
    inner = broker_acquire(stack["client"], JOB)
    calls = {"n": 0}

    @contextlib.contextmanager
    def killing(request: SandboxRequest) -> Iterator[Sandbox]:
        calls["n"] += 1
        with inner(request) as sb:
            assert isinstance(sb, Sandbox)
            if calls["n"] == 1:
                core_v1.delete_namespaced_pod(
                    sb.lease.pod_name, stack["namespace"], grace_period_seconds=0
                )
                wait_until(lambda: not sb.healthy(timeout=1), 60, what="execd gone")
            yield sb

    result = Grader(killing, dataclasses.replace(CFG, max_attempts=3)).grade(
        task, task.reference_patch
    )
    print("\nattempts:", [(a.outcome, a.error_kind, a.durations) for a in result.attempts])
    assert [a.outcome for a in result.attempts] == ["infra_error", "graded"]
    assert result.attempts[0].error_kind == "sandbox_lost"
    assert result.verdict is Verdict.RESOLVED


def test_preflight_cli_through_the_broker(stack: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "report"
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "sandman"), "preflight", str(SWE / "task.json"),
         str(SPECS / "vacuous.yaml"), "--job", JOB, "-j", "2", "--out", str(out),
         "--cpu", "0.5", "--memory", "512Mi"],
        cwd=REPO, env=stack["env"], capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr  # one task is excluded
    doc = json.loads((out / "preflight.json").read_text())
    assert doc["counts"] == {"ok": 1, "empty_passes": 1}, doc
    assert (out / "excluded.txt").read_text() == "sandman-demo/statlib-vacuous\n"
    assert (out / "preflight.md").exists()

"""End to end in a real headless Chromium against gunicorn, real PostgreSQL and Redis,
and real local (bubblewrap) sandboxes created through the broker service.

Screenshots of every page go to ``artifacts/screenshots/`` (gitignored). Under CI=true a
missing browser fails the run; elsewhere it skips.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis as redis_lib

from broker.acquire import weights
from broker.acquire.service import Broker
from broker.backends.base import PodSpec
from broker.backends.local import LocalBackend
from broker.ledger import store
from broker.ledger.models import Sandbox
from broker.ledger.states import State
from broker.ownership.gc import run_gc
from broker.settings import Settings
from broker.wire.request import AcquireRequest
from tests.conftest import unavailable
from tests.support.images import TASK_IMAGE
from tests.support.web_app import ADMIN_TOKEN

pytestmark = pytest.mark.integration
CHROMIUM = os.environ.get("SANDMAN_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
REPO = Path(__file__).resolve().parents[3]
SHOTS = REPO / "artifacts" / "screenshots"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def stack(database_url, redis_url, tmp_path_factory):
    if shutil.which("bwrap") is None:
        unavailable("bubblewrap", "bwrap not installed (apt-get install bubblewrap)")
    state = tmp_path_factory.mktemp("e2e-state")
    url = redis_url.rsplit("/", 1)[0] + "/12"
    client = redis_lib.Redis.from_url(url)
    client.flushdb()
    settings = Settings(
        state_dir=state, database_url=database_url, redis_url=url, admin_token=ADMIN_TOKEN,
        secret_key=secrets.token_hex(16), installation_id="e2e-web", backend="local",
    )  # fmt: skip
    port = _free_port()
    env = dict(os.environ)
    env.update(
        SANDMAN_STATE_DIR=str(state), SANDMAN_DATABASE_URL=database_url,
        SANDMAN_REDIS_URL=url, SANDMAN_ADMIN_TOKEN=ADMIN_TOKEN,
        SANDMAN_SECRET_KEY=settings.secret_key, SANDMAN_INSTALLATION_ID="e2e-web",
        SANDMAN_BACKEND="local", PYTHONPATH=str(REPO),
    )  # fmt: skip
    log = (state / "gunicorn.log").open("wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "-b", f"127.0.0.1:{port}", "-w", "2",
         "--threads", "4", "web.wsgi:app"],
        env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(base + "/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            pytest.fail("gunicorn did not start:\n" + (state / "gunicorn.log").read_text())
        time.sleep(0.2)
    from broker.ledger.db import make_engine, make_session_factory

    engine = make_engine(database_url, pool_size=2)
    sessions = make_session_factory(engine)
    backend = LocalBackend(settings)
    broker = Broker(settings, sessions, backend, client, enqueue=lambda *a: None, actor="e2e")
    yield {"base": base, "broker": broker, "sessions": sessions, "backend": backend,
           "settings": settings}  # fmt: skip
    for meta in backend.list_all_labelled(settings.namespace):
        backend.delete(meta.namespace, meta.name, meta.nonce or "")
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()
    log.close()
    engine.dispose()
    client.close()


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        unavailable("Chromium", f"{CHROMIUM} missing (apt-get install -y chromium)")
    os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        unavailable("playwright", exc)

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def shot(page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def plant_unowned_pod(stack, job: str) -> tuple[str, str]:
    """A real local pod with our labels and a nonce no ledger row carries."""
    nonce = secrets.token_hex(16)
    name = f"sm-planted-{nonce[:8]}"
    stack["backend"].create(PodSpec(
        name=name, namespace=stack["settings"].namespace, installation="e2e-web", job=job,
        sandbox_id=uuid.uuid4().hex, nonce=nonce, role="rollout", image=TASK_IMAGE,
        cpu_m=100, memory_b=64 << 20, token=secrets.token_hex(8),
    ))  # fmt: skip
    return name, nonce


def acquire(stack, job: str):
    """One real acquire through the broker service: pacer, intent, local pod, readiness."""
    return stack["broker"].acquire(AcquireRequest.parse({
        "request_id": f"r-{uuid.uuid4().hex}", "job": job, "image": TASK_IMAGE,
        "cpu_m": 500, "memory_b": 256 << 20, "enqueued_at": time.time(),
        "deadline": time.time() + 60,
    }))  # fmt: skip


def test_operator_flow_in_a_real_browser(stack, browser):
    job = f"e2e-{secrets.token_hex(3)}"
    with stack["sessions"].begin() as s:
        store.ensure_job(s, job, readiness_budget_s=30.0, lease_s=600.0)
    weights.set_job_weight(stack["sessions"], job, 2.5, actor="admin:e2e")
    base = stack["base"]
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    page.set_default_timeout(15_000)

    # log in
    page.goto(base + "/sandboxes?refresh=1")
    assert "/login" in page.url
    shot(page, "01-login")
    page.fill("input[name=name]", "e2e")
    page.fill("input[name=secret]", ADMIN_TOKEN)
    page.click("button[type=submit]")
    page.wait_for_url(base + "/sandboxes?refresh=1")
    assert page.locator(".actor").inner_text() == "admin:e2e"

    # a sandbox acquired through the broker appears without a page reload
    page.evaluate("window.__noReload = 1")
    lease = acquire(stack, job)
    link = page.locator(f"#sandboxes a:has-text('{lease.sandbox_id[:12]}')")
    link.wait_for()
    assert page.evaluate("window.__noReload") == 1
    shot(page, "03-sandboxes")

    # its detail page: ledger row, live pod read-back, event history
    link.click()
    page.wait_for_url(f"{base}/sandboxes/{lease.sandbox_id}")
    assert page.locator("#row-state").inner_text() == "ready"
    assert page.locator("#pod-status").inner_text() == "present"
    assert page.locator("#events tbody tr").count() >= 3
    shot(page, "04-sandbox-detail")

    # a little more history for the overview: two more acquires, one released
    more = [acquire(stack, job) for _ in range(2)]
    stack["broker"].provider.release(more[0].sandbox_id, reason="test-done")
    page.goto(base + "/")
    assert int(page.locator("#stat-live").inner_text()) >= 2
    # every start recorded whether it pulled: the task image is listed with its starts
    pulls = page.locator(f"#image-pulls tr:has-text('{TASK_IMAGE}')")
    assert pulls.count() == 1
    starts = int(pulls.locator("td").nth(1).inner_text())
    assert starts >= 3, pulls.inner_text()
    # each job's share of the create rate in the last minute, with its weight
    # (listed for its weight even if the run was slow and its creates left the minute)
    share = page.locator(f"#fair-shares tr:has-text('{job}')")
    assert share.count() == 1
    cells = [share.locator("td").nth(i).inner_text() for i in range(6)]
    assert cells[2] == "2.5" and int(cells[4]) >= 0 and cells[5].endswith("%"), cells
    shot(page, "02-overview")

    # a planted leak shows up live on the leaks page after a GC pass
    page.goto(base + "/leaks?refresh=1")
    page.evaluate("window.__noReload = 1")
    pod_name, nonce = plant_unowned_pod(stack, job)
    broker = stack["broker"]
    report = run_gc(broker.provider)
    assert pod_name in report.unowned_pods
    row = page.locator(f"#leaks tr:has-text('{pod_name}')")
    row.wait_for()
    assert page.evaluate("window.__noReload") == 1
    shot(page, "05-leaks")

    # resolve it: the confirmation shows its labels; delete needs the box ticked
    row.locator("a:has-text('Resolve')").click()
    labels = page.locator("#pod-labels").inner_text()
    assert nonce in labels and "sandman.io/installation" in labels
    shot(page, "06-leak-confirm")
    delete = page.locator("form:has(#do-delete)")
    delete.locator("input[name=confirmed]").check()
    delete.locator("#do-delete").click()
    page.wait_for_url(base + "/leaks")
    assert "deleted" in page.locator(".flash-ok").inner_text()
    assert page.locator(f"#leaks tr:has-text('{pod_name}')").count() == 0
    assert stack["backend"].get(stack["settings"].namespace, pod_name) is None
    shot(page, "07-leaks-resolved")

    # jobs and pools; the audit trail names the operator
    page.goto(base + "/jobs")
    assert page.locator(f"#jobs tr:has-text('{job}')").count() == 1
    shot(page, "08-jobs")
    page.goto(f"{base}/audit?actor=admin:e2e")
    assert page.locator("#audit tr:has-text('leak-deleted')").count() == 1
    shot(page, "09-audit")

    for sid in (lease.sandbox_id, more[1].sandbox_id):
        stack["broker"].provider.release(sid, reason="test-done")
    with stack["sessions"]() as s:
        assert s.get(Sandbox, lease.sandbox_id).state == State.DELETED
    page.close()


def test_metrics_and_api_over_http(stack):
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    metrics = httpx.get(stack["base"] + "/metrics", headers=headers, timeout=10)
    assert metrics.status_code == 200 and "sandman_redis_up 1" in metrics.text
    assert "sandman_pacer_tokens " in metrics.text
    overview = httpx.get(stack["base"] + "/api/overview", headers=headers, timeout=10).json()
    assert set(overview["queue_depth"]) == {"acquire", "release", "pool"}
    assert all(isinstance(v, int) for v in overview["queue_depth"].values())

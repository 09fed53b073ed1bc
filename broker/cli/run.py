"""Commands that run the system (up, demo, worker, beat, job, acquire, release).

Registered by ``broker.cli.main``. Celery processes are started as subprocesses
(``python -m celery -A workers.app``), so ``broker`` never imports ``workers``.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import signal
import sys
import threading
from typing import Any

import click

from broker.cli.common import settings_of, tool_root
from broker.names import Task
from broker.settings import Settings


def _settings(ctx: click.Context, **overrides: Any) -> Settings:
    settings = settings_of(ctx)
    overrides = {k: v for k, v in overrides.items() if v not in (None, "")}
    return dataclasses.replace(settings, **overrides) if overrides else settings


def _exec_celery(settings: Settings, argv: list[str]) -> None:
    from broker.local.services import ensure_services
    from broker.local.stack import child_env

    urls = ensure_services(settings)
    env = child_env(settings, urls.database_url, urls.redis_url)
    os.execve(sys.executable, argv, env)  # noqa: S606 (fixed argv, no shell)


def register(group: click.Group) -> None:
    """Attach this module's commands to the ``sandman`` group."""

    @group.command("worker")
    @click.option("--queues", "-Q", default="acquire,release,pool", show_default=True)
    @click.option("--concurrency", "-c", default=32, show_default=True, help="Threads.")
    @click.pass_context
    def worker(ctx: click.Context, queues: str, concurrency: int) -> None:
        """Run a Celery worker (threads pool) on the given queues."""
        from broker.local.stack import worker_argv

        _exec_celery(_settings(ctx), worker_argv("worker", queues, concurrency))

    @group.command("beat")
    @click.pass_context
    def beat(ctx: click.Context) -> None:
        """Run Celery beat: the GC pass and pool upkeep on their schedule."""
        from broker.local.stack import beat_argv

        settings = _settings(ctx)
        schedule = settings.state_dir / "run" / "celerybeat-schedule"
        schedule.parent.mkdir(parents=True, exist_ok=True)
        _exec_celery(settings, beat_argv(schedule))

    @group.command("up")
    @click.option("--kubeconfig", default=None, help="Run sandboxes on this cluster.")
    @click.option("--no-web", is_flag=True, help="Do not start the admin UI.")
    @click.pass_context
    def up(ctx: click.Context, kubeconfig: str | None, no_web: bool) -> None:
        """Start everything on this machine and keep it running; Ctrl-C stops it all.

        A child that exits is restarted with backoff; a crash loop stops the stack. A stop
        deletes this installation's local sandboxes (their rows close), and a start
        reclaims whatever an unclean stop left."""
        from broker.errors import ServiceUnavailable
        from broker.local.stack import Stack

        settings = _settings(ctx)
        if kubeconfig:
            settings = dataclasses.replace(settings, backend="kubernetes", kubeconfig=kubeconfig)
        stack = Stack(settings)
        stop = threading.Event()
        supervising = threading.Event()

        def on_signal(signum: int, _frame: object) -> None:
            stop.set()
            if not supervising.is_set():
                raise KeyboardInterrupt  # still starting: abandon the start, then stop
            click.echo(f"{signal.Signals(signum).name}: stopping", err=True)

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        reason = "interrupted while starting"
        failed = False
        try:
            stack.start(web=not no_web)
            click.echo(f"sandman up: backend={settings.backend}, logs in {stack.logs}")
            for name, proc in stack.procs.items():
                click.echo(f"  {name}: pid {proc.pid}")
            click.echo("Ctrl-C to stop (this installation's local sandboxes are deleted).")
            supervising.set()
            reason = stack.supervise(stop, echo=lambda line: click.echo(line, err=True))
            failed = not stop.is_set()
        except KeyboardInterrupt:
            pass
        except ServiceUnavailable as exc:
            reason, failed = str(exc), True
        finally:
            # A second Ctrl-C must not cut the drain short and leave sandboxes behind.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            click.echo(f"stopping: {reason}", err=failed)
            stack.stop(echo=click.echo)
            click.echo("stopped")
        if failed:
            sys.exit(1)

    @group.command("demo")
    @click.option("--rollouts", default=48, show_default=True)
    @click.option("--concurrency", default=8, show_default=True)
    @click.option("--warm", default=12, show_default=True, help="Warm pool size (0: off).")
    @click.option("--commands", default=12, show_default=True)
    @click.pass_context
    def demo(ctx: click.Context, rollouts: int, concurrency: int, warm: int, commands: int) -> None:
        """Bring the stack up (or reuse it), run synthetic rollouts, print a summary."""
        from broker.local.demo import run_demo

        ok = run_demo(
            _settings(ctx),
            rollouts=rollouts,
            concurrency=concurrency,
            warm=warm,
            commands=commands,
            echo=click.echo,
        )
        sys.exit(0 if ok else 1)

    @group.group("job")
    def job() -> None:
        """Jobs: pacing, caps, budgets, warm pools, reuse. Acquires need an existing job."""

    @job.command("create")
    @click.argument("name")
    @click.option("--rate", type=float, default=None, help="Per-job creates per second.")
    @click.option("--burst", type=int, default=None)
    @click.option("--max-live", type=int, default=None)
    @click.option("--max-concurrent", type=int, default=None)
    @click.option(
        "--warm",
        "warm",
        multiple=True,
        help="IMAGE[:TAG]=SIZE[,cpu=500m,memory=1Gi,idle=300]; repeatable.",
    )
    @click.option("--reuse/--no-reuse", default=False)
    @click.option("--max-reuses", type=int, default=None)
    @click.option("--lease-s", type=float, default=None)
    @click.option("--readiness-budget-s", type=float, default=None)
    @click.option(
        "--idle-timeout-s",
        type=click.FloatRange(min=0),
        default=None,
        help="Reclaim a held sandbox after this long with no execd call and no command "
        "running (0: never, the default). Warm pools keep their own idle=.",
    )
    @click.option(
        "--snapshot-bytes",
        type=click.IntRange(min=0),
        default=None,
        help="Quota: the most bytes the job's live snapshots may list (default: no limit).",
    )
    @click.option(
        "--egress",
        default=None,
        metavar="allow|deny|CIDR[,CIDR...]",
        help="The job's egress policy: allow (default), deny, or deny except these CIDRs.",
    )
    @click.option(
        "--hot-image",
        "hot_images",
        multiple=True,
        metavar="IMAGE",
        help="Pull IMAGE ahead onto the job's nodes and keep it there (repeatable; "
        "warm-pool images are pre-pulled anyway).",
    )
    @click.option(
        "--tenant",
        default=None,
        metavar="NAME|none",
        help="Move the job to this tenant (its quotas apply; audited); none: to no tenant.",
    )
    @click.pass_context
    def job_create(  # noqa: PLR0917 (click passes options positionally)
        ctx: click.Context,
        name: str,
        rate: float | None,
        burst: int | None,
        max_live: int | None,
        max_concurrent: int | None,
        warm: tuple[str, ...],
        reuse: bool,
        max_reuses: int | None,
        lease_s: float | None,
        readiness_budget_s: float | None,
        idle_timeout_s: float | None,
        snapshot_bytes: int | None,
        egress: str | None,
        hot_images: tuple[str, ...],
        tenant: str | None,
    ) -> None:
        """Create or update job NAME."""
        from broker.errors import SandmanError
        from broker.ledger import store

        settings = _settings(ctx)
        config: dict[str, Any] = {"reuse": reuse}
        for key, value in (
            ("create_rate", rate),
            ("create_burst", burst),
            ("max_live", max_live),
            ("max_concurrent_creates", max_concurrent),
            ("lease_s", lease_s),
            ("readiness_budget_s", readiness_budget_s),
            ("snapshot_bytes", snapshot_bytes),
        ):
            if value is not None:
                config[key] = value
        config["max_reuses"] = max_reuses if max_reuses is not None else settings.max_reuses
        if idle_timeout_s is not None:
            config["idle_timeout_s"] = idle_timeout_s or None  # 0: off
        try:
            if warm:
                config["warm_pools"] = [parse_warm(w, settings.idle_timeout_s) for w in warm]
            if egress is not None:
                config.update(parse_egress(egress))
            if hot_images:
                from broker.images import refs

                for image in hot_images:
                    refs.normalize(image)  # ImageInvalid for what is not a reference
                config["hot_images"] = list(hot_images)
        except (ValueError, SandmanError) as exc:
            raise click.ClickException(str(exc)) from exc
        try:
            root = tool_root(settings, actor="cli")
        except SandmanError as exc:
            raise click.ClickException(str(exc)) from exc
        try:
            with root.sessions.begin() as session:
                store.ensure_job(session, name, **config)
            if tenant is not None:
                from broker.acquire import quotas
                from broker.cli.tenants import actor

                to = None if tenant.strip().lower() == "none" else tenant
                quotas.assign_job(root.sessions, name, to, actor=actor())
            with root.sessions() as session:
                row = store.get_job(session, name)
                click.echo(
                    json.dumps(
                        {
                            "job": row.name,
                            "warm_pools": row.warm_pools,
                            "create_rate": row.create_rate,
                            "idle_timeout_s": row.idle_timeout_s,
                            "reuse": row.reuse,
                            "egress": row.egress,
                            "egress_allow": row.egress_allow,
                            "hot_images": row.hot_images,
                            "tenant": row.tenant,
                        }
                    )
                )
        except SandmanError as exc:
            raise click.ClickException(str(exc)) from exc
        finally:
            root.dispose()

    @group.command("acquire")
    @click.option("--job", required=True)
    @click.option("--image", required=True)
    @click.option("--cpu", default="1")
    @click.option("--memory", default="1Gi")
    @click.option("--timeout", type=float, default=120.0)
    @click.pass_context
    def acquire(  # noqa: PLR0917
        ctx: click.Context, job: str, image: str, cpu: str, memory: str, timeout: float
    ) -> None:
        """Acquire one sandbox and print its lease (token included); release it yourself."""
        from broker.client.sync import SandboxClient

        client = SandboxClient.from_settings(_settings(ctx), heartbeat_s=3600)
        sandbox = client.open(image=image, job=job, cpu=cpu, memory=memory, timeout=timeout)
        click.echo(json.dumps(sandbox.lease.to_dict(), indent=2))

    @group.command("release")
    @click.argument("sandbox_id")
    @click.pass_context
    def release(ctx: click.Context, sandbox_id: str) -> None:
        """Queue the release of SANDBOX_ID."""
        from broker.client.sync import QUEUE_RELEASE, SandboxClient

        client = SandboxClient.from_settings(_settings(ctx))
        client.send(Task.RELEASE, [sandbox_id, "released"], QUEUE_RELEASE)
        click.echo(f"release of {sandbox_id} queued")


def parse_egress(text: str) -> dict[str, Any]:
    """``allow`` | ``deny`` | ``CIDR[,CIDR...]`` -> the job's ``egress``/``egress_allow``.

    A CIDR list means "deny, except these destinations" (the job store's ``allowlist``);
    ``allow`` and ``deny`` clear the list, so a later ``deny`` never keeps old holes.
    """
    from broker.errors import InvalidRequest

    word = text.strip()
    if word in ("allow", "deny"):
        return {"egress": word, "egress_allow": []}
    cidrs = [c.strip() for c in word.split(",")]
    try:
        nets = [str(ipaddress.ip_network(c, strict=True)) for c in cidrs]
    except ValueError as exc:
        raise InvalidRequest(
            f"--egress {text!r}: expected allow, deny or comma-separated CIDRs ({exc})"
        ) from exc
    return {"egress": "allowlist", "egress_allow": nets}


def parse_warm(text: str, default_idle_s: float) -> dict[str, Any]:
    """``image=SIZE[,cpu=..,memory=..,idle=..,digest=..,commit=..]`` -> a warm_pools entry."""
    from broker.errors import InvalidRequest
    from broker.pools.store import PoolConfig

    head, _, rest = text.partition(",")
    image, sep, size = head.rpartition("=")
    if not sep:
        raise InvalidRequest(f"--warm {text!r}: expected IMAGE=SIZE[,key=value...]")
    raw: dict[str, Any] = {"image": image, "size": int(size)}
    names = {
        "cpu": "cpu",
        "memory": "memory",
        "idle": "idle_timeout_s",
        "digest": "image_digest",
        "commit": "base_commit",
    }
    for part in filter(None, rest.split(",")):
        key, _, value = part.partition("=")
        if key not in names:
            raise InvalidRequest(f"--warm: unknown key {key!r}")
        raw[names[key]] = float(value) if key == "idle" else value
    cfg = PoolConfig.parse(raw, default_idle_s)
    return {
        "image": cfg.image,
        "image_digest": cfg.image_digest,
        "base_commit": cfg.base_commit,
        "cpu_m": cfg.cpu_m,
        "memory_b": cfg.memory_b,
        "size": cfg.size,
        "idle_timeout_s": cfg.idle_timeout_s,
    }

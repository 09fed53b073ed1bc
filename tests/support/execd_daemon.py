"""Fixtures that run execd as a real subprocess on 127.0.0.1 and talk HTTP to it."""

from __future__ import annotations

import base64
import functools
import http.client
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.support.wait import wait_until

REPO = Path(__file__).resolve().parents[2]


@functools.cache
def oldest_python(user: int | None = None) -> str:
    """The oldest working Python 3.8+ here: execd must run on what task images ship.

    With ``user``, the oldest one that uid can run: pyenv's builds live under ``$HOME``,
    which another uid may not be able to traverse (root's home is often 0700)."""
    roots = [Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"]
    candidates = []
    for minor in range(8, 14):
        candidates += sorted(
            str(p) for r in roots for p in r.glob(f"3.{minor}.*/bin/python3.{minor}")
        )
        candidates += [shutil.which(f"python3.{minor}") or "", f"/usr/bin/python3.{minor}"]
    for exe in [c for c in candidates if c] + [sys.executable]:
        try:
            ok = subprocess.run(
                [exe, "-c", "import sys; assert sys.version_info >= (3, 8)"],
                capture_output=True,
                check=False,
                **({"user": user, "group": user} if user is not None else {}),
            )
        except OSError:  # missing, or not reachable for that uid
            continue
        if ok.returncode == 0:
            return exe
    return sys.executable


class Client:
    """One persistent keep-alive connection, like a trainer's."""

    def __init__(self, port: int, token: str) -> None:
        self.port = port
        self.token = token
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)

    def request(self, method, path, body=None, headers=None, auth=True):
        hdrs = {"Content-Type": "application/json"}
        if auth:
            hdrs["Authorization"] = "Bearer " + self.token
        hdrs.update(headers or {})
        if body is not None and not isinstance(body, (bytes, str)):
            body = json.dumps(body)
        self.conn.request(method, path, body=body, headers=hdrs)
        resp = self.conn.getresponse()
        data = resp.read()
        return resp.status, (json.loads(data) if data else None)

    def post(self, path, body=None, status=200):
        code, doc = self.request("POST", path, {} if body is None else body)
        assert code == status, (code, doc)
        return doc

    def exec(self, command, **kw):
        kw["command"] = command
        return self.post("/v1/exec", kw)

    def write(self, path, data: bytes, **kw):
        kw.update(path=str(path), content_b64=base64.b64encode(data).decode())
        return self.post("/v1/files/write", kw)

    def read(self, path) -> bytes:
        doc = self.post("/v1/files/read", {"path": str(path)})
        data = base64.b64decode(doc["content_b64"])
        assert doc["size"] == len(data)
        return data

    def close(self):
        self.conn.close()


class Daemon:
    def __init__(
        self,
        tmp: Path,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        cwd: Path = REPO,
        python: str | None = None,
        popen_kw: Mapping[str, Any] | None = None,
        token: str | None = None,
        workdir: Path | None = None,
        wrapper: Sequence[str] = (),
    ) -> None:
        self.token = token or secrets.token_hex(16)
        self.workdir = workdir or tmp / "work"
        self.workdir.mkdir(exist_ok=True)
        self.log_path = tmp / "execd.log"
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("SANDMAN_")}
        full_env["SANDMAN_EXECD_TOKEN"] = self.token
        full_env.update(env or {})
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [
                *wrapper,
                python or oldest_python(),
                "-m",
                "execd",
                "--listen",
                "127.0.0.1:0",
                "--workdir",
                str(self.workdir),
                *args,
            ],
            cwd=str(cwd),
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            **(popen_kw or {}),
        )
        self.port = self._wait_port()
        self.pid = self.proc.pid
        self._clients = []

    def _wait_port(self) -> int:
        def listening() -> int:
            m = re.search(r"listening on [^ ]+:(\d+)", self.log())
            if m:
                return int(m.group(1))
            if self.proc.poll() is not None:
                pytest.fail(f"execd exited: {self.log()}")
            return 0

        return wait_until(listening, 20, interval=0.02, what=f"execd to listen ({self.log_path})")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self) -> Client:
        c = Client(self.port, self.token)
        self._clients.append(c)
        return c

    def stop(self):
        for c in self._clients:
            c.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("execd"))
    yield d
    d.stop()


@pytest.fixture
def fresh_daemon(tmp_path):
    d = Daemon(tmp_path)
    yield d
    d.stop()


@pytest.fixture
def client(daemon):
    c = daemon.client()
    yield c
    c.close()


def proc_children(pid: int):
    """(pid, state) of the direct children of ``pid``, read from /proc."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            raw = Path(f"/proc/{name}/stat").read_bytes()
        except OSError:
            continue
        rest = raw[raw.rfind(b")") + 2 :].split()
        if int(rest[1]) == pid:
            out.append((int(name), rest[0].decode()))
    return out

"""A real OCI registry on loopback for tests: the same binaries the local cluster runs
(CNCF distribution's ``registry`` and go-containerregistry's ``crane``, built from the Go
module proxy by deploy/localcluster/build.sh and cached), one private instance per use
with its own storage, so tests can delete blobs or stop it without touching the cluster's.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support.images import REPO
from tests.support.wait import wait_until

BUILD = REPO / "deploy/localcluster/build.sh"
LIB = REPO / "deploy/localcluster/lib.sh"


def registry_binaries() -> tuple[Path, Path]:
    """(registry, crane), built first if the cache lacks them (a no-op when warm)."""
    subprocess.run([str(BUILD), "registry", "crane"], check=True, capture_output=True)
    out = subprocess.run(
        ["bash", "-c", f'source "{LIB}"; echo "$REGISTRY_BIN"; echo "$CRANE_BIN"'],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    return Path(out[0]) / "registry", Path(out[1]) / "crane"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class LoopbackRegistry:
    url: str
    hostport: str
    storage: Path
    crane: Path
    process: subprocess.Popen[bytes] | None = None

    @classmethod
    def running_at(cls, url: str) -> LoopbackRegistry:
        """A registry someone else runs (the local cluster's): push and delete only."""
        return cls(url, url.split("://", 1)[1], Path(), registry_binaries()[1])

    def setting(self, host: str = "localhost") -> str:
        """The SANDMAN_REGISTRIES value that serves ``host/...`` refs from here."""
        return f"{host}={self.url}"

    def push(self, tarball: Path, name: str) -> str:
        """Push a docker-archive as ``name`` (``repo:tag``); return its manifest digest."""
        out = subprocess.run(
            [str(self.crane), "push", "--insecure", str(tarball), f"{self.hostport}/{name}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        return out.rsplit("@", 1)[1]

    def delete_blob(self, repository: str, digest: str) -> None:
        """Remove a blob through the API, as a registry's garbage collection would."""
        answer = httpx.delete(f"{self.url}/v2/{repository}/blobs/{digest}")
        assert answer.status_code == 202, answer.text

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)


def stop_process(process: subprocess.Popen[bytes]) -> None:
    """A server a test started, by its PID: SIGTERM, then SIGKILL if it lingers."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def loopback_registry(workdir: Path) -> Iterator[LoopbackRegistry]:
    registry, crane = registry_binaries()
    port, debug = _free_port(), _free_port()
    storage = workdir / "registry-data"
    storage.mkdir(parents=True, exist_ok=True)
    config = workdir / "registry.yml"
    config.write_text(
        "version: 0.1\n"
        "log: {level: warn, accesslog: {disabled: true}}\n"
        f"storage: {{filesystem: {{rootdirectory: {storage}}}, delete: {{enabled: true}}}}\n"
        f"http: {{addr: 127.0.0.1:{port}, debug: {{addr: 127.0.0.1:{debug}}}}}\n"
    )
    log = (workdir / "registry.log").open("ab")
    process = subprocess.Popen(
        [str(registry), "serve", str(config)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OTEL_TRACES_EXPORTER": "none"},
    )
    url = f"http://127.0.0.1:{port}"
    running = LoopbackRegistry(url, f"127.0.0.1:{port}", storage, crane, process)
    try:
        wait_until(lambda: _answers(url) or process.poll() is not None, timeout=60, what=url)
        assert process.poll() is None, (workdir / "registry.log").read_text()[-2000:]
        yield running
    finally:
        running.stop()
        log.close()


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v2/", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def tiny_image(workdir: Path, ref: str, content: str) -> Path:
    """A one-layer docker-archive holding ``/hello.txt`` (no python: the local backend
    runs execd on the host's interpreter), small enough to push and pull in a blink."""
    root = workdir / f"layer-{hashlib.sha256(content.encode()).hexdigest()[:12]}"
    root.mkdir(parents=True, exist_ok=True)
    (root / "hello.txt").write_text(content)
    layer = workdir / f"{root.name}.tar"
    subprocess.run(["tar", "-C", str(root), "-cf", str(layer), "hello.txt"], check=True)
    archive = workdir / f"{root.name}.image.tar"
    subprocess.run(
        [
            *("python3", str(REPO / "deploy/images/pack_image.py"), "--out", str(archive)),
            *("--tag", ref, "--layer", str(layer), "--cmd", '["/bin/sh"]'),
        ],
        check=True,
        capture_output=True,
    )
    return archive

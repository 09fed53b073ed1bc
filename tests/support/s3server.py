"""A real S3-compatible server on loopback for tests: versitygw (posix backend), built from
the Go module proxy by deploy/localcluster/build.sh and cached like the registry's
binaries, one private instance per test session with its data in a temporary directory
and credentials generated for the run (passed in its environment, never on a command
line). Stopped by its PID. A missing binary is built; a build that fails FAILS the tests
that need it, never skips them.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
from botocore.config import Config

from tests.support.images import REPO
from tests.support.registry import _free_port, stop_process
from tests.support.wait import wait_until

BUILD = REPO / "deploy/localcluster/build.sh"
LIB = REPO / "deploy/localcluster/lib.sh"
REGION = "us-east-1"


def versitygw_binary() -> Path:
    """The server, built first if the cache lacks it (a no-op when warm)."""
    built = subprocess.run([str(BUILD), "versitygw"], check=False, capture_output=True, text=True)
    assert built.returncode == 0, f"building versitygw failed:\n{built.stderr[-3000:]}"
    out = subprocess.run(
        ["bash", "-c", f'source "{LIB}"; echo "$VERSITYGW_BIN"'],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return Path(out) / "versitygw"


@dataclass
class S3Server:
    endpoint: str
    access_key: str
    secret_key: str
    root: Path
    process: subprocess.Popen[bytes]

    def client(self) -> Any:
        """A plain boto3 client, for tests that write behind the store's back."""
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=REGION,
            config=Config(s3={"addressing_style": "path"}),
        )

    def bucket(self, name: str) -> str:
        """Create ``name`` (idempotent)."""
        client = self.client()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=name)
        return name

    def fields(self, url: str) -> dict[str, str]:
        """The settings that point a broker at ``url`` (``s3://bucket/prefix``) here."""
        return {
            "snapshot_store": url,
            "snapshot_s3_endpoint": self.endpoint,
            "snapshot_s3_region": REGION,
            "snapshot_s3_access_key": self.access_key,
            "snapshot_s3_secret_key": self.secret_key,
        }


@contextlib.contextmanager
def loopback_s3(workdir: Path) -> Iterator[S3Server]:
    binary = versitygw_binary()
    port = _free_port()
    root = workdir / "s3-data"
    root.mkdir(parents=True, exist_ok=True)
    access, secret = f"T{secrets.token_hex(8).upper()}", secrets.token_urlsafe(30)
    env = {
        **os.environ,
        "ROOT_ACCESS_KEY_ID": access,
        "ROOT_SECRET_ACCESS_KEY": secret,
        "VGW_REGION": REGION,
    }
    log_path = workdir / "versitygw.log"
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [str(binary), "--port", f"127.0.0.1:{port}", "--quiet", "posix", str(root)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    server = S3Server(f"http://127.0.0.1:{port}", access, secret, root, process)
    try:
        wait_until(
            lambda: _answers(server.endpoint) or process.poll() is not None,
            timeout=60,
            what=server.endpoint,
        )
        assert process.poll() is None, log_path.read_text()[-2000:]
        yield server
    finally:
        stop_process(process)


def _answers(endpoint: str) -> bool:
    try:
        httpx.get(endpoint, timeout=2)  # any HTTP answer (403 unsigned) means it listens
    except httpx.HTTPError:
        return False
    return True


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One server per test session; each user takes its own bucket or prefix."""
    with loopback_s3(tmp_path_factory.mktemp("s3")) as server:
        yield server

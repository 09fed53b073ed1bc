"""The built wheel alone can migrate a database: nothing in it reaches back into a checkout.

An installed package (the broker image, a user's venv) has no repository next to it, so
`sandman db upgrade` must find the Alembic scripts inside the wheel. This builds the wheel,
installs only it (plus its dependencies) into a fresh venv, and runs that venv's `sandman`
from a directory outside the checkout against an empty database on the session's server.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect

from tests.support.databases import fresh_database

pytestmark = pytest.mark.integration

LEDGER_TABLES = {"jobs", "sandboxes", "events", "leaks", "alembic_version"}


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"{cmd[:3]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def wheel(repo_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built from a copy of the checkout's files: pip builds in-tree, and a reused build/
    directory keeps modules that were deleted since, so the wheel would not be the tree's."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    listed = _run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo_root)
    for name in filter(None, listed.split("\0")):
        if (repo_root / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(repo_root / name, source / name)
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)],
        cwd=out,
    )
    (built,) = out.glob("sandman_broker-*.whl")
    return built


def test_wheel_carries_every_migration(wheel: Path, repo_root: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    versions = sorted(p.name for p in (repo_root / "migrations" / "versions").glob("*.py"))
    assert versions, "the repository has no migration versions"
    inside = "broker/ledger/migrations/"
    assert {inside + "env.py", inside + "script.py.mako"} <= names
    assert {inside + "versions/" + v for v in versions} <= names
    assert not any(n.startswith("migrations/") for n in names), "a stray top-level package"


def test_fresh_venv_with_only_the_wheel_runs_db_upgrade(
    wheel: Path,
    service_urls,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path)
    # the wheel's dependencies come from the index (or pip's cache); the project only from it
    _run([str(venv / "bin" / "pip"), "install", "-q", str(wheel)], cwd=tmp_path)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SANDMAN_", "PYTHON", "VIRTUAL_ENV"))
    }
    work = tmp_path / "elsewhere"  # no checkout on sys.path: cwd is outside the repository
    work.mkdir()
    with fresh_database(service_urls.database_url, prefix="sandman_wheel") as url:
        out = _run(
            [str(venv / "bin" / "sandman"), "db", "upgrade"],
            cwd=work,
            env={**env, "SANDMAN_DATABASE_URL": url},
        )
        assert "database at head" in out
        engine = create_engine(url)
        try:
            assert set(inspect(engine).get_table_names()) >= LEDGER_TABLES
        finally:
            engine.dispose()

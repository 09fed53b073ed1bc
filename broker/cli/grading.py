"""Grading commands: ``sandman task validate``, ``sandman task schema``, ``sandman grade``
and ``sandman preflight``. Registered by ``broker.cli.main``."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click

from broker.settings import Settings

TASK_SUFFIXES = (".json", ".yaml", ".yml")


def _task_files(paths: tuple[str, ...]) -> list[Path]:
    """Task files, and Harbor task directories (a directory with task.toml is one task:
    nothing inside it is read as a task file)."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.is_dir() or (path / "task.toml").is_file():
            files.append(path)
            continue
        harbor = {p.parent for p in path.rglob("task.toml")}
        for p in sorted(path.rglob("*")):
            inside = any(h in p.parents for h in harbor)
            if p in harbor or (p.suffix in TASK_SUFFIXES and p.is_file() and not inside):
                files.append(p)
    return files


def _grader(ctx: click.Context, job: str, config: Any) -> Any:
    from broker.client.sync import SandboxClient
    from broker.grading.api import broker_acquire
    from broker.grading.grade import Grader

    settings = ctx.find_root().obj
    assert isinstance(settings, Settings)
    client = SandboxClient.from_settings(settings, owner=f"sandman-grading-cli-{job}")
    return Grader(broker_acquire(client, job), config)


def register(group: click.Group) -> None:
    @group.group("task")
    def task() -> None:
        """Grading task specs."""

    @task.command("validate")
    @click.argument("files", nargs=-1, required=True)
    def validate(files: tuple[str, ...]) -> None:
        """Check task files against the schema; print every error with its path."""
        from broker.grading.spec import check_task_file

        bad = 0
        for path in _task_files(files):
            issues = check_task_file(path)
            if issues:
                bad += 1
                click.echo(f"{path}: INVALID ({len(issues)} error(s))")
                for issue in issues:
                    click.echo(f"  {issue}")
            else:
                click.echo(f"{path}: ok")
        sys.exit(1 if bad else 0)

    @task.command("schema")
    def schema() -> None:
        """Print the published JSON Schema of task files."""
        from broker.grading.schema import task_schema

        click.echo(json.dumps(task_schema(), indent=2))

    @group.command("grade")
    @click.argument("task_file")
    @click.argument("patch_file", required=False)
    @click.option("--job", required=True, help="Job whose configuration grading runs under.")
    @click.option("--attempts", default=3, show_default=True)
    @click.pass_context
    def grade(
        ctx: click.Context, task_file: str, patch_file: str | None, job: str, attempts: int
    ) -> None:
        """Grade PATCH_FILE (default: the empty patch) for TASK_FILE (a task file or a Harbor
        task directory); print the result."""
        from broker.grading.grade import GradeConfig
        from broker.grading.spec import TaskSpecError, load_task

        try:
            spec = load_task(task_file)
        except TaskSpecError as exc:
            raise click.ClickException(str(exc)) from exc
        patch = Path(patch_file).read_bytes() if patch_file else b""
        result = _grader(ctx, job, GradeConfig(max_attempts=attempts)).grade(spec, patch)
        click.echo(json.dumps(result.to_dict(), indent=2, default=str))
        sys.exit({"resolved": 0, "unresolved": 1}.get(result.verdict.value, 2))

    @group.command("preflight")
    @click.argument("tasks", nargs=-1, required=True)
    @click.option("--job", required=True, help="Job whose configuration grading runs under.")
    @click.option("--parallel", "-j", default=4, show_default=True)
    @click.option("--out", "out_dir", default="preflight-report", show_default=True)
    @click.option("--exclude-file", default=None, help="Default: OUT/excluded.txt")
    @click.option("--attempts", default=3, show_default=True, help="Per grading (infra retries).")
    @click.option("--egress-host", default="example.com", show_default=True)
    @click.option("--cpu", default=1.0, show_default=True, help="When a task declares none.")
    @click.option("--memory", default="2Gi", show_default=True, help="When a task declares none.")
    @click.option(
        "--sensitivity",
        is_flag=True,
        help="Also grade the reference under perturbed conditions (hash seeds, TZ, one "
        "visible CPU, egress): report load_bearing and undeclared_dependency per task.",
    )
    @click.pass_context
    def preflight(  # noqa: PLR0917 (click passes options positionally)
        ctx: click.Context,
        tasks: tuple[str, ...],
        job: str,
        parallel: int,
        out_dir: str,
        exclude_file: str | None,
        attempts: int,
        egress_host: str,
        cpu: float,
        memory: str,
        sensitivity: bool,
    ) -> None:
        """Reference patch must pass, empty patch must fail, for every task in TASKS.

        Exit 0 only if every task is ok (and, with --sensitivity, none has an
        undeclared_dependency)."""
        from broker.grading.grade import GradeConfig
        from broker.grading.preflight import (
            PreflightEntry,
            PreflightOptions,
            run_preflight,
            write_reports,
        )
        from broker.grading.spec import TaskSpecError, load_task

        specs, invalid = [], []
        for path in _task_files(tasks):
            try:
                specs.append(load_task(path))
            except TaskSpecError as exc:
                errors = [str(i) for i in exc.issues]
                invalid.append(PreflightEntry(path.stem, "invalid", str(path), errors=errors))
        config = GradeConfig(max_attempts=attempts, egress_host=egress_host, cpu=cpu, memory=memory)
        grader = _grader(ctx, job, config)
        started = time.monotonic()
        with click.progressbar(length=len(specs), label="preflight", show_pos=True) as bar:
            entries = run_preflight(
                grader,
                specs,
                parallel=parallel,
                on_done=lambda _e: bar.update(1),
                options=PreflightOptions(sensitivity=sensitivity),
            )
        entries += invalid
        out = Path(out_dir)
        paths = write_reports(
            entries,
            out,
            meta={
                "job": job,
                "parallel": parallel,
                "tasks": len(entries),
                "wall_s": round(time.monotonic() - started, 1),
                "sensitivity": sensitivity,
            },
            exclude_file=Path(exclude_file) if exclude_file else out / "excluded.txt",
        )
        for e in entries:
            flags = f" load_bearing={','.join(e.load_bearing)}" if e.load_bearing else ""
            if e.undeclared_dependency:
                flags += f" undeclared_dependency={','.join(e.undeclared_dependency)}"
            click.echo(f"{e.status:34} {e.task_id}{flags}")
        click.echo(f"report: {paths['json']} {paths['markdown']}; exclusions: {paths['exclude']}")
        clean = all(e.status == "ok" and not e.undeclared_dependency for e in entries)
        sys.exit(0 if clean else 1)

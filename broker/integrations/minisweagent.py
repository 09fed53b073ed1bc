"""mini-swe-agent on Sandman: ``SandmanEnvironment``, usable from its YAML configs as

    environment:
      environment_class: broker.integrations.minisweagent.SandmanEnvironment
      image: localhost/sandman-swe-task:v1
      job: swe-rl-1

It acquires one sandbox when constructed (as mini-swe-agent's Docker environment starts
its container) and releases it in ``cleanup`` (also on ``with`` exit, at garbage
collection, and at interpreter exit for whatever is still held; a SIGKILLed process
stops renewing its lease and the GC reclaims the sandbox).

``execute(action, cwd, timeout)`` answers exactly as mini-swe-agent's ``LocalEnvironment``:

- each action is a fresh ``bash -c`` one-shot run (execd's own bash; mini-swe-agent's
  Docker environment uses bash too, its local one ``/bin/sh``), stderr merged into stdout
  in order, in ``cwd`` (else ``config.cwd``, else the sandbox's workdir) with
  ``config.env`` and ``forward_env`` added to the sandbox's environment;
- ``{"output", "returncode", "exception_info": ""}`` on completion;
- a timeout is the dict LocalEnvironment builds from ``subprocess.TimeoutExpired``
  (returncode -1, the output so far, ``exception_info`` and ``extra``), after execd killed
  the whole process tree; a missing cwd is the ``FileNotFoundError`` dict;
- the submission sentinel (``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` as the first output
  line, exit 0) raises ``Submitted`` through LocalEnvironment's own check.

Infrastructure failures (``broker.errors.InfrastructureError``: the sandbox or Redis lost,
an acquire timeout; and execd refusing our token or our call timing out) are raised, not
turned into an observation: the agent stops with that exception's name as its exit
status, so the instance is masked and retried, never scored as the model's failure.
"""

from __future__ import annotations

import logging
import os
import subprocess
from typing import Any

from minisweagent.environments.local import LocalEnvironment
from minisweagent.utils.serialize import recursive_merge
from pydantic import BaseModel

from broker.client import Sandbox, SandboxClient
from broker.errors import ExecError
from broker.integrations.common import HELD, INFRASTRUCTURE
from broker.settings import Settings
from broker.wire.services import known_redis_url

__all__ = ["SandmanEnvironment", "SandmanEnvironmentConfig"]

UNAME_FIELDS = ("system", "node", "release", "version", "machine")


class SandmanEnvironmentConfig(BaseModel):
    """The ``environment:`` section of a mini-swe-agent config (``environment_class`` aside)."""

    image: str
    job: str
    cwd: str = ""
    """Where actions run; empty: the sandbox's workdir."""
    env: dict[str, str] = {}
    """Added to the sandbox's environment for every action (reserved names are refused)."""
    forward_env: list[str] = []
    """Host variables copied into every action, when set (``env`` wins on conflict)."""
    timeout: int = 30
    cpu: float | str = 1.0
    memory: str = "1Gi"
    workdir: str | None = None
    """The sandbox's workdir at acquire (the repository, for SWE tasks)."""
    max_output_bytes: int = 10 * 1024 * 1024
    redis_url: str | None = None
    """Default: the broker's settings (SANDMAN_REDIS_URL or the embedded Redis)."""
    acquire: dict[str, Any] = {}
    """Further acquire arguments (``timeout``, ``env``, ``base_commit``...)."""


class SandmanEnvironment:
    """One Sandman sandbox as a mini-swe-agent environment (module doc)."""

    def __init__(
        self,
        *,
        config_class: type = SandmanEnvironmentConfig,
        logger: logging.Logger | None = None,
        **kwargs: Any,
    ) -> None:
        self.logger = logger or logging.getLogger("minisweagent.environment")
        self.config = config_class(**kwargs)
        self._uname: dict[str, str] | None = None
        self.sandbox: Sandbox | None = None
        self.client = SandboxClient(self.config.redis_url or known_redis_url(Settings.from_env()))
        acquire: dict[str, Any] = {
            "cpu": self.config.cpu,
            "memory": self.config.memory,
            **self.config.acquire,
        }
        if self.config.workdir is not None:
            acquire["workdir"] = self.config.workdir
        try:
            self.sandbox = self.client.open(image=self.config.image, job=self.config.job, **acquire)
        except BaseException:
            self.client.close()
            raise
        HELD.add(self.sandbox.id, self.client)
        self.logger.info("acquired Sandman sandbox %s", self.sandbox.id)

    def _held(self) -> Sandbox:
        if self.sandbox is None:
            raise RuntimeError("the environment was cleaned up")
        return self.sandbox

    def _env(self) -> dict[str, str]:
        forwarded = {k: v for k in self.config.forward_env if (v := os.getenv(k)) is not None}
        return forwarded | dict(self.config.env)

    def execute(
        self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None
    ) -> dict[str, Any]:
        """Run one action as LocalEnvironment does (module doc); infrastructure errors raise."""
        command = action.get("command", "")
        cwd = cwd or self.config.cwd
        timeout = timeout or self.config.timeout
        output: dict[str, Any]
        try:
            result = self._held().run(
                "exec 2>&1\n" + command,
                cwd=cwd or None,
                env=self._env(),
                timeout=timeout,
                max_output_bytes=self.config.max_output_bytes,
            )
            if result.timed_out:
                raise subprocess.TimeoutExpired(command, timeout, output=result.stdout)
            output = {"output": result.stdout, "returncode": result.exit_code, "exception_info": ""}
        except INFRASTRUCTURE:
            raise  # the agent stops: a masked instance, not an observation
        except (subprocess.TimeoutExpired, ExecError) as e:  # what LocalEnvironment reports
            error = _local_error(e, cwd)
            raw_output = getattr(error, "output", None) or ""
            output = {
                "output": raw_output,
                "returncode": -1,
                "exception_info": f"An error occurred while executing the command: {error}",
                "extra": {"exception_type": type(error).__name__, "exception": str(error)},
            }
        LocalEnvironment._check_finished(self, output)  # type: ignore[arg-type]  # same sentinel
        return output

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        """The config, the sandbox's ``uname`` (system, release, version, machine: what the
        default templates show) and ``kwargs``, merged as LocalEnvironment merges its own."""
        return recursive_merge(self.config.model_dump(), self._sandbox_uname(), kwargs)

    def _sandbox_uname(self) -> dict[str, str]:
        if self._uname is None:
            script = "uname -s; uname -n; uname -r; uname -v; uname -m"
            result = self._held().run(script, timeout=30)
            lines = result.stdout.splitlines() if result.exit_code == 0 else []
            self._uname = dict(zip(UNAME_FIELDS, lines, strict=False))
        return self._uname

    def serialize(self) -> dict[str, Any]:
        return {
            "info": {
                "config": {
                    "environment": self.config.model_dump(mode="json"),
                    "environment_type": f"{self.__class__.__module__}.{self.__class__.__name__}",
                }
            }
        }

    def cleanup(self) -> None:
        """Release the sandbox and close the client; idempotent."""
        sandbox, self.sandbox = self.sandbox, None
        try:
            if sandbox is not None:
                HELD.discard(sandbox.id)
                sandbox.release()
        finally:
            if sandbox is not None:
                self.client.close()

    def __enter__(self) -> SandmanEnvironment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def __del__(self) -> None:
        if getattr(self, "sandbox", None) is not None:
            self.cleanup()


def _local_error(exc: Exception, cwd: str) -> Exception:
    """The exception LocalEnvironment's subprocess would have raised for this failure."""
    if isinstance(exc, ExecError) and exc.error_code == "bad_cwd":
        return FileNotFoundError(2, "No such file or directory", cwd)
    return exc

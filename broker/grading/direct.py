"""A sandbox that is just an execd you can reach: no broker, no lease.

Used by integration tests (execd processes started by the test) and by operators who
want to grade against an execd they started themselves. Errors map onto the same
typed tree as ``broker.client.sync.Sandbox``: transport failures and 5xx are SandboxLost
(infrastructure), 4xx are ExecError.
"""

from __future__ import annotations

import base64
from typing import Any

import httpx

from broker.client.sync import ExecResult, execd_answer
from broker.errors import SandboxLost


class DirectSandbox:
    def __init__(self, address: str, token: str, *, sandbox_id: str | None = None) -> None:
        self.id = sandbox_id or address
        self._base = f"http://{address}"
        self._http = httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=60.0)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> DirectSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, path: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        try:
            resp = self._http.post(self._base + path, json=body, timeout=timeout)
        except httpx.HTTPError as exc:
            raise SandboxLost(f"execd at {self._base} failed on {path}: {exc}") from exc
        return execd_answer(resp, path, f"execd at {self._base}")

    def exec(
        self, command: str, *, timeout: float = 60.0, max_output_bytes: int | None = None
    ) -> ExecResult:
        body: dict[str, Any] = {"command": command, "timeout": timeout}
        if max_output_bytes is not None:
            body["max_output_bytes"] = max_output_bytes
        data = self._call("/v1/exec", body, timeout + 15.0)
        fields = ExecResult.__dataclass_fields__
        return ExecResult(**{k: v for k, v in data.items() if k in fields})

    def read_file(self, path: str) -> bytes:
        return base64.b64decode(self._call("/v1/files/read", {"path": path}, 60.0)["content_b64"])

    def write_file(self, path: str, content: bytes | str, *, mode: int | None = None) -> int:
        raw = content.encode() if isinstance(content, str) else content
        body: dict[str, Any] = {"path": path, "content_b64": base64.b64encode(raw).decode()}
        if mode is not None:
            body["mode"] = mode
        return int(self._call("/v1/files/write", body, 60.0)["size"])

"""A sandbox that is just an execd you can reach: no broker, no lease.

Used by integration tests (execd processes started by the test) and by operators who
want to grade against an execd they started themselves. It speaks the one protocol
module (``broker.wire.execd``) with the same calls as the leased ``Sandbox``, so its
errors are the same: transport failures and 5xx are SandboxLost (infrastructure), 4xx
are ExecError.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx

from broker.wire.execd import Call, Endpoint, ExecdCalls, RunChunk, RunResult


class DirectSandbox(ExecdCalls):
    def __init__(self, address: str, token: str, *, sandbox_id: str | None = None) -> None:
        self.id = sandbox_id or address
        self._execd = Endpoint(address, token)
        self._http = httpx.Client(timeout=60.0)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> DirectSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, call: Call) -> dict[str, Any]:
        return self._execd.send(self._http, call)

    def _stream(self, call: Call) -> Iterator[RunChunk | RunResult]:
        return self._execd.stream(self._http, call)

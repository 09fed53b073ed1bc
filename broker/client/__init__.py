"""The trainer client: what users write is ``from broker.client import SandboxClient``.

It speaks only the wire (``broker.wire``): a queue message out, a mailbox reply in, then
HTTP to execd. It never starts services and imports nothing server-side.
"""

from broker.client.aio import AsyncSandbox, AsyncSandboxClient
from broker.client.sync import Heartbeats, Sandbox, SandboxClient
from broker.wire.execd import ExecResult, RunChunk, RunResult

__all__ = [
    "AsyncSandbox",
    "AsyncSandboxClient",
    "ExecResult",
    "Heartbeats",
    "RunChunk",
    "RunResult",
    "Sandbox",
    "SandboxClient",
]

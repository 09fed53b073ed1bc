"""The two answers to a run: one JSON document (``/v1/run``) or NDJSON frames (``/v1/run/stream``).

Both consume the same ``Run.events``. The document caps each stream like
``/v1/exec`` (head and tail kept); the stream forwards the first
``max_output_bytes`` of each stream as they come and then only counts, since
what was sent cannot be taken back.
"""

from __future__ import annotations

import json

from . import errors, files
from .output import BoundedCapture
from .run import Run

TYPE_CHECKING = False  # no typing at run time (see execd/__init__.py)
if TYPE_CHECKING:
    from typing import Dict, Iterator

    from .validate import Doc

STREAMS = ("stdout", "stderr")


def _result(run: Run, totals: Dict[str, int], truncated: bool) -> Doc:
    return {
        "exit_code": None if run.timed_out else run.exit_status,
        "stdout_total": totals["stdout"],
        "stderr_total": totals["stderr"],
        "truncated": truncated,
        "timed_out": run.timed_out,
        "duration_s": round(run.duration, 6),
    }


def collect(run: Run) -> Doc:
    """Run to the end and answer with the capped output."""
    caps = {name: BoundedCapture(run.spec.cap) for name in STREAMS}
    for name, data in run.events():
        if data:
            caps[name].feed(data)
    out, err = caps["stdout"], caps["stderr"]
    doc = _result(run, {n: c.total for n, c in caps.items()}, out.truncated or err.truncated)
    doc["stdout"] = out.text()
    doc["stderr"] = err.text()
    if run.spec.binary:
        doc["stdout_b64"] = files.b64encode(out.raw()).decode("ascii")
        doc["stderr_b64"] = files.b64encode(err.raw()).decode("ascii")
    return doc


def _line(doc: Doc) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode() + b"\n"


def frames(run: Run, keepalive: float) -> Iterator[bytes]:
    """Output frames as they come, keepalives in the quiet, the result frame last."""
    totals = {name: 0 for name in STREAMS}
    cap = run.spec.cap
    try:
        for name, data in run.events(keepalive):
            if not data:
                yield b'{"type":"keepalive"}\n'
                continue
            room = max(0, cap - totals[name])
            totals[name] += len(data)
            if room:
                b64 = files.b64encode(data[:room]).decode("ascii")
                yield _line({"type": name, "b64": b64})
        doc = _result(run, totals, any(t > cap for t in totals.values()))
        doc.update(type="result", stdout="", stderr="")
        if run.spec.binary:
            doc.update(stdout_b64="", stderr_b64="")
        yield _line(doc)
    except errors.ExecdError as exc:
        error = {"code": exc.code, "message": exc.message}
        yield _line({"type": "error", "status": exc.status, "error": error})
    finally:
        run.close()  # a client gone mid-stream: the run's tree is killed, its slot freed

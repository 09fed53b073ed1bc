"""Routes: authentication first, then the route, then the body, then the work.

The order matters: an unauthenticated caller learns nothing (not even which
routes exist) and never gets a byte of its body read; a body over the limit is
refused from its Content-Length alone.

One-shot runs (``run``, ``runspec``, ``runreply``), the state baseline (``state``) and
snapshots (``snapshot``; both with ``treescan`` and ``sessionstate``) are imported and
made on their first call: a sandbox that only execs and edits files never carries
them (0.3 MiB of code in every sandbox otherwise).
"""

from __future__ import annotations

import os
import threading
import time

# The C function ``hmac.compare_digest`` falls back to; importing it from ``hmac`` would
# pull in hashlib and OpenSSL's libcrypto (3 MiB of resident memory in every sandbox).
from _operator import _compare_digest as compare_digest

from . import __version__, errors, files, validate
from .activity import Activity
from .output import DEFAULT_MAX_OUTPUT
from .server import Request, Response
from .sessions import Sessions
from .shell import Shell
from .validate import MAX_TIMEOUT_S

TYPE_CHECKING = False  # no typing at run time (see execd/__init__.py)
if TYPE_CHECKING:
    from typing import Callable, Dict, Optional, Tuple, Union

    from .run import Run, Runner
    from .server import BodyReader
    from .snapshot import Snapshots
    from .state import StateKeeper
    from .validate import Doc

    Handler = Callable[[Doc], Union[Doc, Response]]

WRITE = "/v1/files/write"
RUN, RUN_STREAM = "/v1/run", "/v1/run/stream"
SNAPSHOT_PUT = "/v1/snapshot/put"  # a raw, streamed body: never read whole into memory
# The one big string field each route may carry, parsed without a copy (split_big_string).
BIG_FIELDS = {WRITE: "content_b64", RUN: "stdin_b64", RUN_STREAM: "stdin_b64"}


class App:
    """The request handler the server calls; ``token`` empty means no authentication.

    A plain class, not a dataclass: ``dataclasses`` imports ``inspect`` and ``ast``
    (1 MiB per sandbox). No ``__repr__``, so the token is never in a log line."""

    def __init__(
        self,
        token: bytes,
        *,
        shell: Shell,
        rundir: str,
        max_body: int,
        umask: int,
        sessions: Sessions,
        max_runs: int,
        keepalive_s: float,
    ) -> None:
        self.token = token
        self.shell = shell
        self.rundir = rundir
        self.max_body = max_body
        self.umask = umask
        self.sessions = sessions
        self.max_runs = max_runs
        self.keepalive_s = keepalive_s
        self._parts = threading.Lock()  # makes each part below once
        self._runner: Optional[Runner] = None
        self._state: Optional[StateKeeper] = None
        self._snapshots: Optional[Snapshots] = None
        self.started = time.time()
        self.activity = Activity()
        self.routes: Dict[str, Tuple[str, Handler]] = {
            SNAPSHOT_PUT: ("PUT", self.healthz),  # served by Snapshots.put before any body read
            "/healthz": ("GET", self.healthz),
            "/v1/info": ("GET", self.info),
            "/v1/exec": ("POST", self.exec_),
            RUN: ("POST", self.run),
            RUN_STREAM: ("POST", self.run_stream),
            "/v1/sessions/open": ("POST", self.open_session),
            "/v1/sessions/close": ("POST", self.close_session),
            "/v1/files/read": ("POST", self.read),
            "/v1/files/write": ("POST", self.write),
            "/v1/files/edit": ("POST", self.edit),
            "/v1/reset": ("POST", self.reset),
            "/v1/heartbeat": ("POST", self.heartbeat),
            "/v1/reclaim": ("POST", self.reclaim),
            "/v1/baseline": ("POST", self.baseline),
            "/v1/state-check": ("POST", self.state_check),
            "/v1/restore": ("POST", self.restore),
            "/v1/snapshot/capture": ("POST", self._on_snapshots("capture")),
            "/v1/snapshot/blob": ("POST", self._on_snapshots("blob")),
            "/v1/snapshot/prepare": ("POST", self._on_snapshots("prepare")),
            "/v1/snapshot/copy": ("POST", self._on_snapshots("copy")),
            "/v1/snapshot/finish": ("POST", self._on_snapshots("finish")),
        }

    # ---- the parts made on first use (see the module's docstring) ------------------

    def _on_snapshots(self, name: str) -> Handler:
        """The handler ``Snapshots.<name>``, of the snapshots made on the first call."""

        def handler(doc: Doc) -> Union[Doc, Response]:
            result: Union[Doc, Response] = getattr(self.snapshots, name)(doc)
            return result

        return handler

    @property
    def runner(self) -> Runner:
        with self._parts:
            if self._runner is None:
                from .run import Runner

                launch = self.shell.launch
                self._runner = Runner(launch.reaper, launch.env, self.max_runs)
            return self._runner

    @property
    def state(self) -> StateKeeper:
        with self._parts:
            if self._state is None:
                from .state import StateKeeper

                self._state = StateKeeper(self.shell, self.shell.launch.workdir, self.rundir)
            return self._state

    @property
    def snapshots(self) -> Snapshots:
        with self._parts:
            if self._snapshots is None:
                from .snapshot import Snapshots

                workdir = self.shell.launch.workdir
                self._snapshots = Snapshots(self.shell, workdir, self.rundir, self.umask)
            return self._snapshots

    def __call__(self, req: Request, read_body: BodyReader) -> Response:
        if req.path == "/healthz" and req.method == "GET":
            return Response(200, self.healthz({}))
        self._authenticate(req)
        route = self.routes.get(req.path)
        if route is None:
            raise errors.NotFound("no route %s" % req.path, "unknown_route")
        if req.method != route[0]:
            raise errors.MethodNotAllowed("%s takes %s, not %s" % (req.path, route[0], req.method))
        if not self.activity.begin(req.path):
            return self._serve(req, read_body, route[1])
        try:
            resp = self._serve(req, read_body, route[1])
        except BaseException:
            self.activity.end()
            raise
        if resp.length is None:  # a stream: the call runs until the stream is closed
            resp.chunks = self.activity.wrap(resp.chunks)
        else:
            self.activity.end()
        return resp

    def _serve(self, req: Request, read_body: BodyReader, handler: Handler) -> Response:
        if req.path == SNAPSHOT_PUT:
            return Response(200, self.snapshots.put(req, req.stream))
        body = read_body(req, self.max_body)
        req.body = b""  # the raw bytes live on only as long as this request needs them
        big = BIG_FIELDS.get(req.path)
        split = validate.split_big_string(body, big) if big else None
        if split is not None and big:
            doc, doc[big] = split
        else:
            doc = validate.parse_json(body)
        del body
        result = handler(doc)
        return result if isinstance(result, Response) else Response(200, result)

    def authorized(self, req: Request) -> bool:
        """Whether the head carries the token (the server's gate asks this too)."""
        if not self.token:
            return True  # --insecure-no-auth
        header = req.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        # Compare bytes in constant time; never log or echo what was given.
        return scheme.lower() == "bearer" and compare_digest(
            given.strip().encode("latin-1", "replace"), self.token
        )

    def _authenticate(self, req: Request) -> None:
        if not self.authorized(req):
            raise errors.Unauthorized("missing or wrong bearer token")

    # ---- handlers --------------------------------------------------------------

    def healthz(self, _doc: Doc) -> Doc:
        return {"ok": True, "version": __version__}

    def info(self, _doc: Doc) -> Doc:
        out = {
            "version": __version__,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started, 3),
        }
        out.update(self.shell.info())
        out["orphans_reaped"] = self.shell.launch.reaper.orphans_reaped
        out["sessions"] = self.sessions.names()
        runner = self._runner  # not made for this: no run yet means none active or started
        out["runs_active"] = runner.active if runner else 0
        out["runs_started"] = runner.started if runner else 0
        return out

    def heartbeat(self, _doc: Doc) -> Doc:
        return {"ok": True, "uptime_s": round(time.time() - self.started, 3)}

    def reclaim(self, doc: Doc) -> Doc:
        """The broker's idle check (execd/activity.py): reclaim now, or say how idle."""
        if doc.get("idle_timeout_s") is None:
            raise errors.BadRequest("missing field 'idle_timeout_s'", "missing_field")
        timeout = validate.number(doc, "idle_timeout_s", 0.0, 0.0, 1e9)
        held = validate.number(doc, "held_s", 1e18, -1.0, 1e18)
        return self.activity.reclaim(timeout, held)

    def exec_(self, doc: Doc) -> Doc:
        command = validate.string(doc, "command", nul_ok=False)
        timeout = validate.number(doc, "timeout", 300.0, 0.0, MAX_TIMEOUT_S)
        cap = validate.integer(doc, "max_output_bytes", DEFAULT_MAX_OUTPUT, 0, 1 << 30)
        session = validate.string(doc, "session", None, nul_ok=False)
        return self.sessions.get(session).run(command, timeout, cap)

    def _start_run(self, doc: Doc) -> Run:
        from . import runspec

        launch = self.shell.launch
        return self.runner.start(runspec.parse(doc, launch.workdir, launch.bash))

    def run(self, doc: Doc) -> Doc:
        from . import runreply

        return runreply.collect(self._start_run(doc))

    def run_stream(self, doc: Doc) -> Response:
        """Refusals come as statuses; once the run started, as an error frame (runreply)."""
        from . import runreply

        return Response(
            200, chunks=runreply.frames(self._start_run(doc), self.keepalive_s), length=None
        )

    def open_session(self, doc: Doc) -> Doc:
        return self.sessions.open(validate.string(doc, "name", nul_ok=False))

    def close_session(self, doc: Doc) -> Doc:
        return self.sessions.close(validate.string(doc, "name", nul_ok=False))

    def read(self, doc: Doc) -> Response:
        return files.read_response(validate.abs_path(doc))

    def write(self, doc: Doc) -> Doc:
        path = validate.abs_path(doc)
        text = doc.get("content_b64")
        if not isinstance(text, memoryview):  # not already split out of a big body
            text = validate.string(doc, "content_b64", text=False)
        mode = validate.integer(doc, "mode", None, 0, 0o7777)
        return files.write_atomic(path, files.b64_pieces(text), mode, self.umask)

    def edit(self, doc: Doc) -> Doc:
        path = validate.abs_path(doc)
        old = validate.string(doc, "old")
        new = validate.string(doc, "new")
        return files.edit_file(path, old, new, self.umask)

    def reset(self, _doc: Doc) -> Doc:
        return {"ok": True, "killed": self.shell.reset()}

    def baseline(self, doc: Doc) -> Doc:
        return self.state.baseline(doc)

    def state_check(self, doc: Doc) -> Doc:
        return self.state.check(doc)

    def restore(self, doc: Doc) -> Doc:
        return self.state.restore(doc)

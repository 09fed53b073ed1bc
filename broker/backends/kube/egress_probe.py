"""Is egress denial actually enforced? A probe that trusts behaviour, not the policy object.

A NetworkPolicy is inert without an engine that enforces it (the local cluster's bridge
CNI does not; kube-network-policies or Calico/Cilium do). The probe creates the broker's
own egress guard (``podspec.egress_policy``) for a throw-away probe job, runs one pod
labelled ``egress=denied`` and one egress-allowed pod of that job, and has each of them
connect to a target that every pod reaches when nothing enforces:

* by default a TCP listener the probe starts on this host (on the local cluster, the
  bridge address ``10.244.0.1``), which greets with a random nonce so a connection is
  known to have reached *this* listener, and which records the peers it saw;
* or an existing ``host:port`` (``target=``) when the probe runs away from the nodes.

Verdicts: ``enforced`` (the allowed pod connects, the denied pod is blocked),
``not enforced`` (the denied pod connects: the policy exists, nothing enforces it),
``inconclusive`` (even the allowed pod cannot connect, or a pod never ran).

The pods report through their termination message, so the probe needs only
get/create/delete on pods and networkpolicies, no exec and no logs. The probe's pods
carry an installation value of their own (``<installation>-egress-probe``): the broker's
GC and audit never see them. Everything is deleted again, whatever the outcome.
"""

from __future__ import annotations

import contextlib
import enum
import json
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from broker import names
from broker.backends.base import PodSpec
from broker.backends.kube import podspec
from broker.backends.kube.api import Kube, call_json
from broker.errors import ConfigError, KubeNotFound

DEFAULT_LISTEN = "10.244.0.1"  # the local cluster's bridge: every pod there reaches it
DEFAULT_IMAGE = "localhost/sandman-task-base:v1"  # any image with python3 works
DEFAULT_NODE_SELECTOR = {names.LABEL_NODE_KIND: "real"}

# Runs inside each probe pod (python3 >= 3.6, stdlib only). argv[1] is a JSON object.
# After ``delay_s`` (time for the engine to learn the pod's IP from the API), attempts stop
# at the first outcome expected for the pod: connected for the allowed pod, blocked for
# the denied one. A denied pod that is blocked only after an early success still counts
# as enforced (the engine had not seen its IP yet); the message says so.
POD_SCRIPT = r"""
import json, socket, sys, time
a = json.loads(sys.argv[1])
time.sleep(a["delay_s"])
attempts = []
for i in range(a["attempts"]):
    t0 = time.time()
    r = {"connected": False, "banner_ok": None, "error": ""}
    try:
        s = socket.create_connection((a["host"], a["port"]), timeout=a["timeout_s"])
        r["connected"] = True
        if a["banner"]:
            data = b""
            try:
                while not data.endswith(b"\n") and len(data) < 256:
                    chunk = s.recv(256)
                    if not chunk:
                        break
                    data += chunk
            except OSError as e:
                r["error"] = "read: %s: %s" % (type(e).__name__, e)
            r["banner_ok"] = data.strip().decode("ascii", "replace") == a["banner"]
        s.close()
    except OSError as e:
        r["error"] = "%s: %s" % (type(e).__name__, e)
    r["elapsed_s"] = round(time.time() - t0, 3)
    attempts.append(r)
    if r["connected"] == a["stop_when_connected"]:
        break
    time.sleep(a["interval_s"])
out = json.dumps({"attempts": attempts}, separators=(",", ":"))
with open(a.get("report", "/dev/termination-log"), "w") as f:
    f.write(out)
print(out)
"""


class EgressVerdict(enum.StrEnum):
    ENFORCED = "enforced"
    NOT_ENFORCED = "not enforced"
    INCONCLUSIVE = "inconclusive"


@dataclass(frozen=True)
class Attempt:
    connected: bool
    banner_ok: bool | None  # None: no banner expected (target mode) or nothing read
    error: str
    elapsed_s: float


@dataclass(frozen=True)
class PodOutcome:
    """What one probe pod did: its attempts, or why it produced none."""

    pod: str
    egress_denied: bool
    pod_ip: str = ""
    phase: str = ""
    attempts: list[Attempt] = field(default_factory=list)
    problem: str = ""  # set when the pod never reported (unschedulable, image, timeout)

    @property
    def reached(self) -> bool:
        """Did any attempt get through to the target?"""
        return any(a.connected and a.banner_ok is not False for a in self.attempts)

    @property
    def finally_blocked(self) -> bool:
        """Did the last attempt fail to connect at all?"""
        return bool(self.attempts) and not self.attempts[-1].connected


@dataclass(frozen=True)
class EgressProbeResult:
    verdict: EgressVerdict
    message: str
    namespace: str
    target: str
    policy: str
    denied: PodOutcome
    allowed: PodOutcome
    listener_peers: list[str] = field(default_factory=list)
    duration_s: float = 0.0

    @property
    def enforced(self) -> bool:
        return self.verdict is EgressVerdict.ENFORCED

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["verdict"] = str(self.verdict)
        return out


def classify(
    denied: PodOutcome, allowed: PodOutcome, listener_peers: list[str] | None = None
) -> tuple[EgressVerdict, str]:
    """The verdict from what the two pods (and the listener) observed."""
    peers = set(listener_peers or [])
    for outcome in (allowed, denied):
        if outcome.problem:
            return (
                EgressVerdict.INCONCLUSIVE,
                f"pod {outcome.pod} did not report: {outcome.problem}",
            )
    if not allowed.reached:
        last = allowed.attempts[-1].error if allowed.attempts else "no attempt"
        return (
            EgressVerdict.INCONCLUSIVE,
            f"the egress-allowed pod cannot reach the target either ({last}); "
            "choose a target every pod reaches when nothing enforces NetworkPolicy",
        )
    if denied.finally_blocked:
        early = sum(1 for a in denied.attempts if a.connected)
        if denied.pod_ip and denied.pod_ip in peers:
            early = max(early, 1)
        note = (
            f" ({early} early attempt(s) got through before the engine knew the pod)"
            if early
            else ""
        )
        return (
            EgressVerdict.ENFORCED,
            "egress is enforced: the egress-denied pod is blocked, the allowed pod connects" + note,
        )
    return (
        EgressVerdict.NOT_ENFORCED,
        "egress is NOT enforced: the NetworkPolicy exists but the egress-denied pod "
        "connects; no engine enforces NetworkPolicy for this path",
    )


class _Listener:
    """A TCP listener that greets every connection with a nonce and records peers."""

    def __init__(self, address: str, banner: str) -> None:
        self._banner = (banner + "\n").encode()
        self._sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((address, 0))
        except OSError as exc:
            self._sock.close()
            raise ConfigError(
                f"egress probe: cannot listen on {address} ({exc}); the address must be "
                "this host's, reachable from pods (or pass a target instead)"
            ) from exc
        self._sock.listen(16)
        self._sock.settimeout(0.2)
        self.address = address
        self.port = int(self._sock.getsockname()[1])
        self.peers: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="egress-probe", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.peers.append(str(peer[0]))
            with contextlib.suppress(OSError), conn:
                conn.settimeout(2.0)
                conn.sendall(self._banner)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._sock.close()


def _pod_body(spec: PodSpec, args: dict[str, Any], *, deadline_s: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": spec.name, "labels": spec.labels()},
        "spec": {
            "restartPolicy": "Never",
            "enableServiceLinks": False,
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 0,
            "activeDeadlineSeconds": deadline_s,
            "nodeSelector": dict(spec.node_selector),
            "tolerations": list(spec.tolerations),
            "containers": [
                {
                    "name": "probe",
                    "image": spec.image,
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["python3", "-c", POD_SCRIPT, json.dumps(args)],
                    "resources": {
                        "requests": {"cpu": f"{spec.cpu_m}m", "memory": str(spec.memory_b)},
                        "limits": {"cpu": f"{spec.cpu_m}m", "memory": str(spec.memory_b)},
                    },
                }
            ],
        },
    }


def _outcome(spec: PodSpec, pod: dict[str, Any] | None, problem: str = "") -> PodOutcome:
    status = (pod or {}).get("status") or {}
    pod_ip, phase = str(status.get("podIP") or ""), str(status.get("phase") or "")

    def outcome(attempts: list[Attempt], problem: str) -> PodOutcome:
        return PodOutcome(
            pod=spec.name,
            egress_denied=spec.egress_denied,
            pod_ip=pod_ip,
            phase=phase,
            attempts=attempts,
            problem=problem,
        )

    if problem:
        return outcome([], problem)
    for cs in status.get("containerStatuses") or []:
        terminated = (cs.get("state") or {}).get("terminated") or {}
        if not terminated:
            continue
        try:
            report = json.loads(terminated.get("message") or "")
            attempts = [
                Attempt(
                    connected=bool(a["connected"]),
                    banner_ok=a.get("banner_ok"),
                    error=str(a.get("error", "")),
                    elapsed_s=float(a.get("elapsed_s", 0.0)),
                )
                for a in report["attempts"]
            ]
        except (ValueError, KeyError, TypeError):
            reason = terminated.get("reason", "")
            code = terminated.get("exitCode")
            return outcome([], f"no report (exit {code} {reason})".strip())
        return outcome(attempts, "")
    return outcome([], "the container did not terminate")


def _waiting_reason(pod: dict[str, Any] | None) -> str:
    """Why a pod is stuck (ErrImageNeverPull, Unschedulable, ...), for the message."""
    status = (pod or {}).get("status") or {}
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason"):
            return f"{waiting['reason']}: {waiting.get('message', '')}".strip(": ")
    for cond in status.get("conditions") or []:
        if cond.get("status") == "False" and cond.get("reason"):
            return f"{cond['reason']}: {cond.get('message', '')}".strip(": ")
    return str(status.get("phase") or "not created")


@contextlib.contextmanager
def _cleanup(kube: Kube, namespace: str) -> Iterator[Callable[[str, str], None]]:
    """Collects ("pod"|"policy", name) and deletes them all at the end, whatever happens."""
    created: list[tuple[str, str]] = []

    def track(kind: str, name: str) -> None:
        created.append((kind, name))

    try:
        yield track
    finally:
        for kind, name in reversed(created):
            with contextlib.suppress(KubeNotFound):
                if kind == "pod":
                    kube.delete_pod(namespace, name, uid=None, grace_s=0)
                else:
                    call_json(
                        "delete networkpolicy",
                        kube.net.delete_namespaced_network_policy,
                        name,
                        namespace,
                    )


def probe_egress(
    kube: Kube,
    namespace: str,
    *,
    installation: str,
    image: str = DEFAULT_IMAGE,
    node_selector: dict[str, str] | None = None,
    tolerations: list[dict[str, object]] | None = None,
    listen: str = DEFAULT_LISTEN,
    target: str = "",
    timeout_s: float = 60.0,
    connect_timeout_s: float = 2.0,
    attempts: int = 3,
    settle_s: float = 1.5,
) -> EgressProbeResult:
    """Run the probe once in ``namespace`` and return its typed verdict.

    ``target`` (``host:port``) replaces the host listener; then success is a TCP connect.
    Raises ``ConfigError`` when the listener cannot bind and ``KubeError`` when the API
    fails; a pod that never runs gives an ``inconclusive`` result, not an exception.
    """
    t0 = time.monotonic()
    nonce = secrets.token_hex(4)
    job = f"egress-probe-{nonce}"
    probe_installation = f"{installation}-egress-probe"[:63]
    listener: _Listener | None = None
    banner = ""
    if target:
        host, _, port_s = target.rpartition(":")
        if not host or not port_s.isdigit():
            raise ConfigError(f"egress probe: target must be host:port, not {target!r}")
        host, port = host.strip("[]"), int(port_s)
    else:
        banner = f"sandman-egress-probe {nonce}"
        listener = _Listener(listen, banner)
        host, port = listener.address, listener.port
    shown_target = f"{host}:{port}" + ("" if target else " (probe listener)")
    selector = DEFAULT_NODE_SELECTOR if node_selector is None else node_selector
    specs = {
        denied: PodSpec(
            name=f"{job}-{'denied' if denied else 'allowed'}",
            namespace=namespace,
            installation=probe_installation,
            job=job,
            sandbox_id=f"{job}-{'denied' if denied else 'allowed'}",
            nonce=nonce,
            role="egress-probe",
            image=image,
            cpu_m=200,
            memory_b=64 * 1024 * 1024,
            token="",  # no execd in a probe pod
            node_selector=dict(selector),
            tolerations=list(tolerations or []),
            egress_denied=denied,
        )
        for denied in (True, False)
    }
    policy = podspec.egress_policy(job, probe_installation, [])
    policy_name = policy["metadata"]["name"]
    deadline_s = max(10, int(timeout_s))
    try:
        with _cleanup(kube, namespace) as track:
            kube.create_object("networkpolicy", namespace, policy)
            track("policy", policy_name)
            for denied, spec in specs.items():
                args = {
                    "host": host,
                    "port": port,
                    "banner": banner,
                    "delay_s": settle_s,
                    "attempts": attempts,
                    "interval_s": 1.0,
                    "timeout_s": connect_timeout_s,
                    "stop_when_connected": not denied,
                }
                kube.create_pod(namespace, _pod_body(spec, args, deadline_s=deadline_s))
                track("pod", spec.name)
            outcomes = _wait_for_reports(kube, namespace, specs, t0 + timeout_s)
        peers = list(listener.peers) if listener else []
    finally:
        if listener:
            listener.close()
    verdict, message = classify(outcomes[True], outcomes[False], peers)
    return EgressProbeResult(
        verdict=verdict,
        message=message,
        namespace=namespace,
        target=shown_target,
        policy=policy_name,
        denied=outcomes[True],
        allowed=outcomes[False],
        listener_peers=peers,
        duration_s=round(time.monotonic() - t0, 2),
    )


def _wait_for_reports(
    kube: Kube, namespace: str, specs: dict[bool, PodSpec], deadline: float
) -> dict[bool, PodOutcome]:
    outcomes: dict[bool, PodOutcome] = {}
    last: dict[bool, dict[str, Any] | None] = {}
    while len(outcomes) < len(specs):
        for key, spec in specs.items():
            if key in outcomes:
                continue
            pod = kube.get_pod(namespace, spec.name)
            last[key] = pod
            phase = ((pod or {}).get("status") or {}).get("phase")
            if phase in ("Succeeded", "Failed"):
                outcomes[key] = _outcome(spec, pod)
        if len(outcomes) == len(specs):
            break
        if time.monotonic() > deadline:
            for key, spec in specs.items():
                if key not in outcomes:
                    reason = _waiting_reason(last.get(key))
                    outcomes[key] = _outcome(spec, last.get(key), f"timed out ({reason})")
            break
        time.sleep(0.3)
    return outcomes


def format_result(result: EgressProbeResult) -> str:
    lines = [f"egress: {result.verdict} - {result.message}"]
    lines.append(f"  namespace {result.namespace}, policy {result.policy}, target {result.target}")
    for outcome in (result.denied, result.allowed):
        kind = "denied " if outcome.egress_denied else "allowed"
        if outcome.problem:
            lines.append(f"  {kind} pod {outcome.pod}: {outcome.problem}")
            continue
        tries = ", ".join(
            "connected" if a.connected and a.banner_ok is not False else (a.error or "failed")
            for a in outcome.attempts
        )
        lines.append(f"  {kind} pod {outcome.pod} ({outcome.pod_ip}): {tries}")
    if result.listener_peers:
        lines.append(f"  listener saw: {', '.join(sorted(set(result.listener_peers)))}")
    lines.append(f"  took {result.duration_s:.1f}s")
    return "\n".join(lines)

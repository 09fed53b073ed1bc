"""The one place the kubernetes client is used; ApiException becomes a typed error here.

Status mapping: 404 KubeNotFound, 409 KubeConflict, 400/422 KubeInvalid, 429
KubeThrottled (with Retry-After), 5xx and every transport error or timeout
KubeUnavailable (outcome unknown: the caller reads back). urllib3's own retries are off,
so a POST is never silently replayed underneath the ownership protocol.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal, TypeVar
from urllib.parse import quote

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from broker.errors import (
    KubeConflict,
    KubeError,
    KubeInvalid,
    KubeNotFound,
    KubeThrottled,
    KubeUnavailable,
)
from broker.wire.validation import json_object

T = TypeVar("T")
REQUEST_TIMEOUT = (5.0, 30.0)  # connect, read


def load_api_client(kubeconfig: str = "", *, qps_pool: int = 64) -> client.ApiClient:
    """An ApiClient from a kubeconfig file, or in-cluster config when none is given."""
    configuration = client.Configuration()
    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    else:
        config.load_incluster_config(client_configuration=configuration)
    configuration.retries = False
    configuration.connection_pool_maxsize = qps_pool
    return client.ApiClient(configuration)


def _retry_after(exc: ApiException) -> float | None:
    headers = exc.headers or {}
    value = headers.get("Retry-After") or headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def translate(exc: BaseException, what: str) -> KubeError:
    """Map a client exception to the error tree (never leaks the response body)."""
    if isinstance(exc, ApiException):
        status = int(exc.status or 0)
        message = f"{what}: HTTP {status} {exc.reason or ''}".strip()
        if status == 404:
            return KubeNotFound(message, status=status)
        if status == 409:
            return KubeConflict(message, status=status)
        if status in (400, 422):
            return KubeInvalid(f"{message}: {_reason_message(exc)}", status=status)
        if status == 429:
            return KubeThrottled(message, status=status, retry_after=_retry_after(exc))
        if status >= 500 or status == 0:
            return KubeUnavailable(message, status=status or None)
        return KubeError(message, status=status)
    return KubeUnavailable(f"{what}: {type(exc).__name__}: {exc}")


def _reason_message(exc: ApiException) -> str:
    try:
        return str(json.loads(exc.body or "{}").get("message", ""))[:500]
    except (ValueError, AttributeError):
        return ""


_TRANSPORT = (urllib3.exceptions.HTTPError, OSError, TimeoutError)


def call(what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Invoke one API call with a request timeout; translate every failure."""
    kwargs.setdefault("_request_timeout", REQUEST_TIMEOUT)
    try:
        return fn(*args, **kwargs)
    except (ApiException, *_TRANSPORT) as exc:
        raise translate(exc, what) from exc


def call_json(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Like ``call`` but returns the response body as plain JSON.

    The generated client's model deserialization (and ``sanitize`` back to dicts) cost
    about 57 ms of CPU per pod create in the scale profile; the broker only ever wants
    dicts, so it asks for the raw body and parses it once.
    """
    kwargs.setdefault("_request_timeout", REQUEST_TIMEOUT)
    try:
        resp = fn(*args, _preload_content=False, **kwargs)
        try:
            data = resp.data
        finally:
            resp.release_conn()
    except (ApiException, *_TRANSPORT) as exc:
        raise translate(exc, what) from exc
    return json_object(data, KubeUnavailable, what)


# Where ``Kube.post`` creates each kind of namespaced object.
COLLECTIONS = {
    "pod": "/api/v1/namespaces/{namespace}/pods",
    "configmap": "/api/v1/namespaces/{namespace}/configmaps",
    "secret": "/api/v1/namespaces/{namespace}/secrets",
    "networkpolicy": "/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies",
    "daemonset": "/apis/apps/v1/namespaces/{namespace}/daemonsets",
}


def post_json(
    api_client: client.ApiClient, what: str, path: str, body: dict[str, Any]
) -> dict[str, Any]:
    """POST a plain dict through the client's own connection pool, TLS and credentials,
    and return the response body as plain JSON.

    Why not the generated method: it validates the body into its pydantic model (a whole
    ``V1Pod``) and dumps it back to a dict before sending, about a fifth of an acquire
    worker's CPU per create on the scale run, for a body the broker built itself and the
    API server validates anyway. Errors are the generated client's (``translate``)."""
    cfg = api_client.configuration
    headers = {
        **api_client.default_headers,
        "Accept": "application/json",
        "Content-Type": "application/json",
    }
    for auth in cfg.auth_settings().values():  # the bearer token, refreshed by its hook
        if auth.get("in") == "header" and auth.get("value"):
            headers[str(auth["key"])] = str(auth["value"])
    connect, read = REQUEST_TIMEOUT
    try:
        resp = api_client.rest_client.pool_manager.request(
            "POST",
            cfg.host + path,
            body=json.dumps(body),
            headers=headers,
            timeout=urllib3.Timeout(connect=connect, read=read),
            preload_content=False,
        )
        try:
            data = resp.data
        finally:
            resp.release_conn()
    except _TRANSPORT as exc:
        raise translate(exc, what) from exc
    if not 200 <= resp.status < 300:
        raise translate(ApiException(http_resp=resp), what)
    return json_object(data, KubeUnavailable, what)


READ_ATTEMPTS = 3


def read_json(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """``call_json`` for reads, retried (3 tries, 0.1 s then 0.3 s apart) when the outcome
    is unknown or throttled. A GET changes nothing, so replaying it is safe; it is what
    turns a pooled keep-alive connection killed by an API server restart into a
    non-event instead of a failed create. Writes are never retried here."""
    for attempt in range(READ_ATTEMPTS):
        try:
            return call_json(what, fn, *args, **kwargs)
        except (KubeUnavailable, KubeThrottled) as exc:
            if attempt == READ_ATTEMPTS - 1:
                raise
            pause = 0.1 * 3**attempt
            if isinstance(exc, KubeThrottled) and exc.retry_after:
                pause = max(pause, min(exc.retry_after, 5.0))
            time.sleep(pause)
    raise AssertionError("unreachable")


def read_json_or_none(what: str, fn: Callable[..., Any], *args: Any) -> dict[str, Any] | None:
    """``read_json`` where a 404 is an answer (the object is absent), not an error."""
    try:
        return read_json(what, fn, *args)
    except KubeNotFound:
        return None


# The first name and resourceVersion of a watch event's line: the object's own (the API
# server writes metadata first, its name first).
_EVENT_NAME = re.compile(rb'"metadata":\{"name":"([^"]*)"')
_EVENT_VERSION = re.compile(rb'"resourceVersion":"([^"]*)"')


def _event(line: bytes, wanted: Callable[[str], bool] | None) -> dict[str, Any]:
    """One watch line as JSON; an object ``wanted`` refuses by name is not parsed, only
    its resourceVersion is kept (a ``SKIPPED`` event), so a watch can resume after it."""
    if wanted is not None:
        found = _EVENT_NAME.search(line)
        if found is not None and not wanted(found.group(1).decode()):
            version = _EVENT_VERSION.search(line)
            meta = {"resourceVersion": version.group(1).decode() if version else ""}
            return {"type": "SKIPPED", "object": {"metadata": meta}}
    data: dict[str, Any] = json.loads(line)
    return data


def _json_lines(resp: Any, wanted: Callable[[str], bool] | None = None) -> Iterator[dict[str, Any]]:
    """Parse a watch stream (one JSON object per line) without the client's models."""
    pending = b""
    for chunk in resp.stream(amt=None, decode_content=True):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.strip():
                yield _event(line, wanted)
    if pending.strip():
        yield _event(pending, wanted)


# The namespaced side objects ``Kube.get_object``/``create_object`` handle.
ObjectKind = Literal["configmap", "networkpolicy", "secret", "daemonset"]


class Kube:
    """Thin typed facade over the few API groups the broker uses."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)
        self.net = client.NetworkingV1Api(api_client)
        self.apps = client.AppsV1Api(api_client)

    def create_pod(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.post("pod", namespace, body)

    def post(self, kind: str, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        """Create one object of ``kind`` (a key of COLLECTIONS); see ``post_json``."""
        path = COLLECTIONS[kind].format(namespace=quote(namespace, safe=""))
        return post_json(self.api_client, f"create {kind}", path, body)

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return read_json_or_none("read pod", self.core.read_namespaced_pod, name, namespace)

    def delete_pod(self, namespace: str, name: str, *, uid: str | None, grace_s: int = 0) -> None:
        """Delete with a UID precondition, so a same-named replacement is never removed."""
        options = client.V1DeleteOptions(
            grace_period_seconds=grace_s,
            propagation_policy="Background",
            preconditions=client.V1Preconditions(uid=uid) if uid else None,
        )
        call_json("delete pod", self.core.delete_namespaced_pod, name, namespace, body=options)

    def list_pods(self, namespace: str, selector: str) -> tuple[list[dict[str, Any]], str]:
        """All pods matching ``selector`` (paged), and the list's resourceVersion."""
        items: list[dict[str, Any]] = []
        token: str | None = None
        version = ""
        while True:
            data = read_json(
                "list pods",
                self.core.list_namespaced_pod,
                namespace,
                label_selector=selector,
                limit=2000,
                _continue=token,
            )
            items.extend(data.get("items") or [])
            version = (data.get("metadata") or {}).get("resourceVersion", "")
            token = (data.get("metadata") or {}).get("continue")
            if not token:
                return items, version

    def pod_events(self, namespace: str, name: str) -> list[dict[str, Any]]:
        """The events the node and scheduler recorded for pod ``name`` (one read)."""
        data = read_json(
            "list events",
            self.core.list_namespaced_event,
            namespace,
            field_selector=f"involvedObject.kind=Pod,involvedObject.name={name}",
            limit=100,
        )
        return list(data.get("items") or [])

    def current_version(self, namespace: str, selector: str) -> str:
        """The resourceVersion a watch can start from, without listing every pod."""
        data = read_json(
            "list pods", self.core.list_namespaced_pod, namespace, label_selector=selector, limit=1
        )
        return str((data.get("metadata") or {}).get("resourceVersion", ""))

    def watch_pods(
        self,
        namespace: str,
        *,
        field_selector: str = "",
        label_selector: str = "",
        resource_version: str = "",
        timeout_s: float = 5.0,
        wanted: Callable[[str], bool] | None = None,
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Yield (event type, pod) until timeout; raises KubeError(410) when too old.

        BOOKMARK events are passed on (they carry only a newer resourceVersion), and so
        are SKIPPED ones: a pod whose name ``wanted`` refuses, left unparsed."""
        kwargs: dict[str, Any] = {
            "watch": True,
            "timeout_seconds": max(1, int(timeout_s)),
            "_request_timeout": (5.0, timeout_s + 5.0),
            "_preload_content": False,
        }
        if field_selector:
            kwargs["field_selector"] = field_selector
        if label_selector:
            kwargs["label_selector"] = label_selector
        if resource_version:
            kwargs["resource_version"] = resource_version
            kwargs["allow_watch_bookmarks"] = True
        resp: Any = None  # a urllib3 response: _preload_content=False
        try:
            resp = self.core.list_namespaced_pod(namespace, **kwargs)
            for event in _json_lines(resp, wanted):
                kind = event.get("type", "")
                obj = event.get("object")
                raw = obj if isinstance(obj, dict) else {}
                if kind == "ERROR":
                    raise KubeError(
                        f"watch error: {raw.get('message', '')}",
                        status=int(raw.get("code", 0) or 0),
                    )
                yield kind, raw
        except (ApiException, *_TRANSPORT) as exc:
            raise translate(exc, "watch pods") from exc
        except ValueError as exc:
            raise KubeUnavailable(f"watch pods: malformed event: {exc}") from exc
        finally:
            if resp is not None:
                resp.close()
                resp.release_conn()

    def _reader(self, kind: ObjectKind) -> Callable[..., Any]:
        """The generated client's read of ``kind``: the broker's side objects (the execd
        configmap, job owners, egress policies, execd token secrets) are all read the same
        way, and created by ``post``, so one ``get_object``/``create_object`` serves them."""
        if kind == "configmap":
            return self.core.read_namespaced_config_map
        if kind == "secret":
            return self.core.read_namespaced_secret
        if kind == "daemonset":
            return self.apps.read_namespaced_daemon_set
        return self.net.read_namespaced_network_policy

    def get_object(self, kind: ObjectKind, namespace: str, name: str) -> dict[str, Any] | None:
        return read_json_or_none(f"read {kind}", self._reader(kind), name, namespace)

    def create_object(
        self, kind: ObjectKind, namespace: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        return self.post(kind, namespace, body)

    def list_daemonsets(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        data = read_json(
            "list daemonsets",
            self.apps.list_namespaced_daemon_set,
            namespace,
            label_selector=selector,
        )
        return list(data.get("items") or [])

    def delete_daemonset(self, namespace: str, name: str, *, uid: str | None) -> None:
        """Delete with a UID precondition; its pods go with it (foreground is not needed:
        they hold nothing but a pulled image)."""
        options = client.V1DeleteOptions(
            propagation_policy="Background",
            preconditions=client.V1Preconditions(uid=uid) if uid else None,
        )
        call_json(
            "delete daemonset",
            self.apps.delete_namespaced_daemon_set,
            name,
            namespace,
            body=options,
        )

    def delete_secret(self, namespace: str, name: str, *, uid: str | None) -> None:
        """Delete with a UID precondition, like a pod: never a same-named replacement."""
        options = client.V1DeleteOptions(
            preconditions=client.V1Preconditions(uid=uid) if uid else None
        )
        call_json(
            "delete secret", self.core.delete_namespaced_secret, name, namespace, body=options
        )

    def ensure_namespace(self, name: str, *, timeout_s: float = 60.0) -> None:
        """Make sure pods can be created in ``name``.

        Reads the namespace's default ServiceAccount first (the least-privilege Role allows
        exactly that), so an installed broker never needs cluster-wide rights; only when it
        is missing does it create the namespace, then waits for the ServiceAccount, without
        which ServiceAccount admission rejects every pod (even with automount off).
        """
        deadline = time.monotonic() + timeout_s
        created = False
        while not self.namespace_ready(name):
            if not created:
                created = True
                try:
                    call(
                        "create namespace",
                        self.core.create_namespace,
                        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}},
                    )
                except KubeConflict:
                    pass
                except KubeError as exc:
                    raise KubeError(
                        f"namespace {name} is not ready and the broker may not create it "
                        f"({exc}); create it with the deploy manifests",
                        status=exc.status,
                    ) from exc
            if time.monotonic() > deadline:
                raise KubeNotFound(
                    f"namespace {name}: no default ServiceAccount after {timeout_s}s"
                )
            time.sleep(0.2)

    def namespace_ready(self, name: str) -> bool:
        """True when pods can be created in ``name``: its default ServiceAccount exists.

        A read the least-privilege Role allows; False for a missing namespace (or one whose
        ServiceAccount controller has not caught up yet). Other errors (403) propagate."""
        try:
            call("read serviceaccount", self.core.read_namespaced_service_account, "default", name)
        except KubeNotFound:
            return False
        return True

    def delete_namespace(self, name: str) -> None:
        with contextlib.suppress(KubeNotFound):
            call("delete namespace", self.core.delete_namespace, name)

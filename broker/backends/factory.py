"""The one place a pod backend is built from settings (the kubernetes client is imported
only when asked for: no kubernetes on laptops).

``ensure_namespace`` says whether this process may create the sandbox namespace: the
workers may (so a fresh cluster with a non-default ``SANDMAN_NAMESPACE`` works without a
``kubectl create ns``), the read-only admin UI may not. Both check it up front, so a missing
namespace or a refused permission is one clear ``NamespaceUnavailable`` at start instead
of a ``kube_not_found`` on every create.
"""

from __future__ import annotations

from broker.backends.base import Backend
from broker.settings import Settings


def make_backend(settings: Settings, *, ensure_namespace: bool) -> Backend:
    if settings.backend == "kubernetes":
        from broker.backends.kube.backend import KubeBackend

        backend = KubeBackend.from_settings(settings)
        backend.ensure_namespace(settings.namespace, create=ensure_namespace)
        return backend
    from broker.backends.local import LocalBackend

    return LocalBackend(settings)

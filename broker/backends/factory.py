"""Pick the backend named by the settings (imports lazily: no kubernetes client on laptops)."""

from __future__ import annotations

from broker.backends.base import Backend
from broker.settings import Settings


def make_backend(settings: Settings) -> Backend:
    if settings.backend == "kubernetes":
        from broker.backends.kube.backend import KubeBackend

        backend = KubeBackend.from_settings(settings)
        backend.ensure_namespace(settings.namespace)
        return backend
    from broker.backends.local import LocalBackend

    return LocalBackend(settings)

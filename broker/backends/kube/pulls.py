"""What the node says about a pod's image pull, read from the kubelet's events.

The pod object does not say whether its start pulled: the kubelet records it only as an
event (``Pulled``: "Successfully pulled image ... in 2.1s (2.1s including waiting)" or
"Container image ... already present on machine"). One list of the pod's events after
Ready answers it, on real nodes only (simulated nodes record no pulls).
"""

from __future__ import annotations

import re
from typing import Any

_PULLED_IN = re.compile(r"Successfully pulled image .*? in ([0-9.hmsµun]+)")
_GO_DURATION = re.compile(r"([0-9.]+)(h|ms|m|s|µs|us|ns)")
_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "µs": 1e-6, "us": 1e-6, "ns": 1e-9}


def go_duration_s(text: str) -> float | None:
    """A Go ``time.Duration`` string (``1m3.5s``, ``512ms``) in seconds; None if not one."""
    parts = _GO_DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    return sum(float(n) * _UNIT_S[u] for n, u in parts)


def pull_from_events(events: list[dict[str, Any]]) -> tuple[bool | None, float | None]:
    """(pulled, seconds) from a pod's events: (True, s) when the kubelet pulled the image,
    (False, 0.0) when it was already present, (None, None) when no event says either."""
    pulled: bool | None = None
    seconds: float | None = None
    for event in events:
        if event.get("reason") != "Pulled":
            continue
        message = str(event.get("message") or "")
        found = _PULLED_IN.search(message)
        if found:
            pulled, seconds = True, go_duration_s(found.group(1))
        elif "already present" in message and pulled is None:
            pulled, seconds = False, 0.0
    return pulled, seconds

"""Input checks for acquire requests: reject nonsense before anything is written.

Limits are deliberately generous (a 64-core, 512 GiB sandbox is legal) but absurd values
(zero CPU, a petabyte of memory, an image name with spaces) fail with InvalidRequest,
whose ``field`` names the offending field. ``broker.wire.request.AcquireRequest`` is the
one caller for requests; warm-pool configs reuse the parsers. ``json_object`` is the one
check of a peer's answer (execd, the Kubernetes API server) that must be a JSON object.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from broker.errors import InvalidRequest, SandmanError

# A pragmatic form of the OCI reference grammar: [registry/]path[:tag][@digest].
_IMAGE = re.compile(
    r"^(?:[a-z0-9]+(?:[._-][a-z0-9]+)*(?::[0-9]+)?/)?"
    r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[a-f0-9]{64})?\Z"
)
_DIGEST = re.compile(r"^sha256:[a-f0-9]{64}\Z")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}\Z")
MIN_CPU_M, MAX_CPU_M = 10, 64_000
MIN_MEMORY_B, MAX_MEMORY_B = 16 << 20, 512 << 30
_CPU = re.compile(r"^(?:(\d+)m|(\d+(?:\.\d{1,3})?))$")
_MEM = re.compile(r"^(\d+)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_MEM_UNITS = {
    None: 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 1 << 10,
    "Mi": 1 << 20,
    "Gi": 1 << 30,
    "Ti": 1 << 40,
}


def validate_image(image: object) -> None:
    if not isinstance(image, str) or len(image) > 512 or not _IMAGE.match(image):
        raise InvalidRequest(f"invalid image reference {image!r}", field="image")


def parse_cpu(value: str | int | float) -> int:
    """'500m', '2', 1.5 -> millicores; InvalidRequest on anything else or out of range."""
    if isinstance(value, bool):
        raise InvalidRequest(f"invalid cpu {value!r}", field="cpu")
    if isinstance(value, int | float):
        millis = round(value * 1000)
    else:
        match = _CPU.match(str(value).strip())
        if not match:
            raise InvalidRequest(f"invalid cpu {value!r}: use e.g. '500m' or '2'", field="cpu")
        millis = int(match.group(1)) if match.group(1) else round(float(match.group(2)) * 1000)
    if not MIN_CPU_M <= millis <= MAX_CPU_M:
        raise InvalidRequest(
            f"cpu {value!r} outside {MIN_CPU_M}m..{MAX_CPU_M // 1000}", field="cpu"
        )
    return millis


def parse_memory(value: str | int) -> int:
    """'512Mi', '2Gi', 1073741824 -> bytes; InvalidRequest on anything else or out of range."""
    if isinstance(value, bool):
        raise InvalidRequest(f"invalid memory {value!r}", field="memory")
    if isinstance(value, int):
        size = value
    else:
        match = _MEM.match(str(value).strip())
        if not match:
            raise InvalidRequest(
                f"invalid memory {value!r}: use e.g. '512Mi' or '2Gi'", field="memory"
            )
        size = int(match.group(1)) * _MEM_UNITS[match.group(2)]
    if not MIN_MEMORY_B <= size <= MAX_MEMORY_B:
        raise InvalidRequest(f"memory {value!r} outside 16Mi..512Gi", field="memory")
    return size


def check_int_range(name: str, value: object, low: int, high: int) -> int:
    """An exact integer (never a bool, a float or a numeric string) within [low, high]."""
    if type(value) is not int or not low <= value <= high:
        raise InvalidRequest(
            f"{name} must be an integer in {low}..{high}, not {value!r}", field=name
        )
    return value


def check_text(name: str, value: object, *, optional: bool, max_len: int = 512) -> str | None:
    """A printable string without NUL or line breaks (they would forge log and label lines)."""
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value or len(value) > max_len:
        raise InvalidRequest(f"{name} must be a non-empty string of at most {max_len}", field=name)
    if any(c in value for c in "\x00\r\n"):
        raise InvalidRequest(f"{name} contains a control character", field=name)
    return value


def check_request_id(value: object) -> str:
    if not isinstance(value, str) or not _REQUEST_ID.match(value):
        raise InvalidRequest(
            "request_id must be 1-128 chars of [A-Za-z0-9_.:-]", field="request_id"
        )
    return value


def check_digest(value: object) -> str | None:
    if value is not None and (not isinstance(value, str) or not _DIGEST.match(value)):
        raise InvalidRequest(f"invalid image digest {value!r}", field="image_digest")
    return value


def check_workdir(value: object) -> str:
    if not isinstance(value, str) or not value.startswith("/") or "\x00" in value:
        raise InvalidRequest(f"workdir must be an absolute path, not {value!r}", field="workdir")
    return value


def check_env(value: object) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise InvalidRequest("env must be a mapping of names to strings", field="env")
    for name, item in value.items():
        if not (isinstance(name, str) and _ENV_NAME.match(name)) or not isinstance(item, str):
            raise InvalidRequest(
                f"env must map names [A-Za-z_][A-Za-z0-9_]* to strings: {name!r}", field="env"
            )
        if "\x00" in item:
            raise InvalidRequest(f"env value of {name} contains NUL", field="env")
    return dict(value)


def check_time(name: str, value: object) -> float:
    """A finite epoch timestamp in seconds (the queue carries floats, JSON has no dates)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1e11:
        raise InvalidRequest(f"{name} must be epoch seconds, not {value!r}", field=name)
    return float(value)


def json_object(content: bytes | str, error: type[SandmanError], where: str) -> dict[str, Any]:
    """Parse an answer that must be one JSON object, or raise ``error`` naming ``where``.

    The caller picks the error because what a garbled answer means depends on who sent
    it: a sandbox that went away (execd) or an API server whose outcome is unknown."""
    try:
        data = json.loads(content)
    except ValueError as exc:
        raise error(f"{where}: response is not JSON") from exc
    if not isinstance(data, dict):
        raise error(f"{where}: response is not a JSON object")
    return data

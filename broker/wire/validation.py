"""Input checks for acquire requests: reject nonsense before anything is written.

Limits are deliberately generous (a 64-core, 512 GiB sandbox is legal) but absurd values
(zero CPU, a petabyte of memory, an image name with spaces) fail with InvalidRequest.
"""

from __future__ import annotations

import re

from broker.errors import InvalidRequest
from broker.wire.types import AcquireSpec

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


def validate_image(image: str) -> None:
    if not isinstance(image, str) or len(image) > 512 or not _IMAGE.match(image):
        raise InvalidRequest(f"invalid image reference {image!r}")


def parse_cpu(value: str | int | float) -> int:
    """'500m', '2', 1.5 -> millicores; InvalidRequest on anything else or out of range."""
    if isinstance(value, bool):
        raise InvalidRequest(f"invalid cpu {value!r}")
    if isinstance(value, int | float):
        millis = round(value * 1000)
    else:
        match = _CPU.match(str(value).strip())
        if not match:
            raise InvalidRequest(f"invalid cpu {value!r}: use e.g. '500m' or '2'")
        millis = int(match.group(1)) if match.group(1) else round(float(match.group(2)) * 1000)
    if not MIN_CPU_M <= millis <= MAX_CPU_M:
        raise InvalidRequest(f"cpu {value!r} outside {MIN_CPU_M}m..{MAX_CPU_M // 1000}")
    return millis


def parse_memory(value: str | int) -> int:
    """'512Mi', '2Gi', 1073741824 -> bytes; InvalidRequest on anything else or out of range."""
    if isinstance(value, bool):
        raise InvalidRequest(f"invalid memory {value!r}")
    if isinstance(value, int):
        size = value
    else:
        match = _MEM.match(str(value).strip())
        if not match:
            raise InvalidRequest(f"invalid memory {value!r}: use e.g. '512Mi' or '2Gi'")
        size = int(match.group(1)) * _MEM_UNITS[match.group(2)]
    if not MIN_MEMORY_B <= size <= MAX_MEMORY_B:
        raise InvalidRequest(f"memory {value!r} outside 16Mi..512Gi")
    return size


def validate_spec(spec: AcquireSpec) -> None:
    validate_image(spec.image)
    if spec.image_digest is not None and (
        not isinstance(spec.image_digest, str) or not _DIGEST.match(spec.image_digest)
    ):
        raise InvalidRequest(f"invalid image digest {spec.image_digest!r}")
    if not MIN_CPU_M <= spec.cpu_m <= MAX_CPU_M:
        raise InvalidRequest(f"cpu {spec.cpu_m}m outside {MIN_CPU_M}m..{MAX_CPU_M}m")
    if not MIN_MEMORY_B <= spec.memory_b <= MAX_MEMORY_B:
        raise InvalidRequest(f"memory {spec.memory_b} bytes outside 16Mi..512Gi")
    if spec.request_id is not None and not _REQUEST_ID.match(spec.request_id):
        raise InvalidRequest("request_id must be 1-128 chars of [A-Za-z0-9_.:-]")
    if spec.workdir and not spec.workdir.startswith("/"):
        raise InvalidRequest(f"workdir must be absolute, not {spec.workdir!r}")
    for name, value in (spec.env or {}).items():
        if not (isinstance(name, str) and _ENV_NAME.match(name)) or not isinstance(value, str):
            raise InvalidRequest(f"env must map names [A-Za-z_][A-Za-z0-9_]* to strings: {name!r}")
        if "\x00" in value:
            raise InvalidRequest(f"env value of {name} contains NUL")

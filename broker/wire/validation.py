"""Input checks for acquire requests: reject nonsense before anything is written.

Limits are deliberately generous (a 64-core, 512 GiB sandbox is legal) but absurd values
(zero CPU, a petabyte of memory, an image name with spaces) fail with InvalidRequest,
whose ``field`` names the offending field. ``broker.wire.request.AcquireRequest`` is the
one caller for requests; warm-pool configs reuse the parsers. ``json_object`` is the one
check of a peer's answer (execd, the Kubernetes API server) that must be a JSON object.
"""

from __future__ import annotations

import json
import math
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
_MAX_QUANTITY = 32  # a quantity string longer than this is nonsense (and int() of it is slow)
_CPU = re.compile(r"^(?:(\d+)m|(\d+(?:\.\d{1,3})?))\Z")
_MEM = re.compile(r"^(\d+)(Ki|Mi|Gi|Ti|k|M|G|T)?\Z")
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
    """'500m', '2', 1.5 -> millicores; InvalidRequest on anything else or out of range.

    NaN, infinities and overlong strings are refused before any arithmetic: ``round`` of
    them raises ValueError/OverflowError, which would reach the trainer untyped."""
    if isinstance(value, bool) or (isinstance(value, float) and not math.isfinite(value)):
        raise InvalidRequest(f"invalid cpu {value!r}", field="cpu")
    if isinstance(value, int | float):
        millis = round(value * 1000) if abs(value) <= MAX_CPU_M else MAX_CPU_M + 1
    else:
        if not isinstance(value, str) or len(value) > _MAX_QUANTITY:
            raise InvalidRequest(f"invalid cpu {value!r}: use e.g. '500m' or '2'", field="cpu")
        match = _CPU.match(value.strip())
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
        if not isinstance(value, str) or len(value) > _MAX_QUANTITY:
            raise InvalidRequest(
                f"invalid memory {value!r}: use e.g. '512Mi' or '2Gi'", field="memory"
            )
        match = _MEM.match(value.strip())
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


MAX_WORKDIR = 4096  # PATH_MAX


def check_workdir(value: object) -> str:
    """An absolute path without NUL or line breaks: a NUL used to pass the type check and
    fail later inside ``subprocess`` as an untyped ValueError, after a port was locked."""
    if (
        not isinstance(value, str)
        or not value.startswith("/")
        or len(value) > MAX_WORKDIR
        or any(c in value for c in "\x00\r\n")
    ):
        raise InvalidRequest(
            f"workdir must be an absolute path of at most {MAX_WORKDIR} characters without "
            f"NUL or line breaks, not {value!r:.100}",
            field="workdir",
        )
    return value


MAX_ENV_VARS = 128
MAX_ENV_NAME = 128
MAX_ENV_VALUE = 32 * 1024
MAX_ENV_TOTAL = 128 * 1024
# Names a request may not set, and why. The request's env becomes the environment of
# execd itself (the pod's env, or bubblewrap's --setenv) and of every command it runs:
# - SANDMAN_*: the broker's own channel into the sandbox (SANDMAN_EXECD_TOKEN[_FILE|_FD]
#   choose execd's token: a trainer could pick the token of a sandbox it hands to others;
#   SANDMAN_EXECD_CALL marks a call's processes) and the broker's settings.
# - LD_PRELOAD, LD_LIBRARY_PATH, LD_AUDIT (any LD_*): load code into execd and every
#   binary before main, so the guard and the token check can be bypassed.
# - PYTHONPATH, PYTHONHOME, PYTHONSTARTUP, PYTHONINSPECT, PYTHONUSERBASE: replace the
#   interpreter's modules (PYTHONPATH=/sandman is how execd itself is found).
# - BASH_ENV, ENV: a file every non-interactive bash/sh sources before each command, so
#   every exec (and grading's test command) would run the trainer's code first.
# - IFS: re-splits every unquoted word in a shell script, which changes what a command runs.
_RESERVED_ENV = frozenset(
    {
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTHONSTARTUP",
        "PYTHONINSPECT",
        "PYTHONUSERBASE",
        "BASH_ENV",
        "ENV",
        "IFS",
    }
)
_RESERVED_ENV_PREFIXES = ("SANDMAN_", "LD_")


def reserved_env_name(name: str) -> bool:
    return name in _RESERVED_ENV or name.startswith(_RESERVED_ENV_PREFIXES)


def check_env(value: object) -> dict[str, str]:
    """Names [A-Za-z_][A-Za-z0-9_]*, string values without NUL, bounded in count and size,
    and none of the reserved names above."""
    if not isinstance(value, Mapping):
        raise InvalidRequest("env must be a mapping of names to strings", field="env")
    if len(value) > MAX_ENV_VARS:
        raise InvalidRequest(f"env has more than {MAX_ENV_VARS} variables", field="env")
    total = 0
    for name, item in value.items():
        if not (
            isinstance(name, str) and len(name) <= MAX_ENV_NAME and _ENV_NAME.match(name)
        ) or not isinstance(item, str):
            raise InvalidRequest(
                f"env must map names [A-Za-z_][A-Za-z0-9_]* to strings: {name!r:.100}",
                field="env",
            )
        if reserved_env_name(name):
            raise InvalidRequest(
                f"env may not set {name}: SANDMAN_*, LD_*, PYTHONPATH, PYTHONHOME, "
                "PYTHONSTARTUP, PYTHONINSPECT, PYTHONUSERBASE, BASH_ENV, ENV and IFS are "
                "reserved",
                field="env",
            )
        if "\x00" in item:
            raise InvalidRequest(f"env value of {name} contains NUL", field="env")
        if len(item) > MAX_ENV_VALUE:
            raise InvalidRequest(
                f"env value of {name} is longer than {MAX_ENV_VALUE} characters", field="env"
            )
        total += len(name) + len(item)
    if total > MAX_ENV_TOTAL:
        raise InvalidRequest(f"env is larger than {MAX_ENV_TOTAL} characters", field="env")
    return dict(value)


def check_time(name: str, value: object) -> float:
    """A finite epoch timestamp in seconds (the queue carries floats, JSON has no dates)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not 0 < value < 1e11
    ):
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

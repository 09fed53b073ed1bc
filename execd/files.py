"""Reading, atomic writing and string-replace editing of sandbox files.

Writes go to a temporary file in the target's directory, are fsynced and
renamed over the target, so a reader never sees half a file and a crash leaves
either the old or the new content. The editor is the agent's most used tool;
it must never corrupt a file, so it works on exact bytes: it refuses what it
could not write back byte-exactly (non-UTF-8 files) and tells the agent to use
the shell, keeps BOM, line endings and the final newline as they were, and
verifies length and SHA-256 of what landed on disk.
"""

from __future__ import annotations

import binascii
import errno
import os
import re
import stat

from . import errors
from .edit import SHELL_HINT, apply_edit
from .errors import suppress
from .server import Close, Response

TYPE_CHECKING = False  # no typing at run time (see execd/__init__.py)
if TYPE_CHECKING:
    import hashlib
    from typing import Iterable, Iterator, List, Optional, Tuple, Union

    from .validate import Doc

STREAM_OVER = 4 * 1024 * 1024  # larger reads are streamed, not built in memory
PIECE = 3 * 1024 * 1024  # a multiple of 3: base64 pieces concatenate cleanly
MAX_EDIT_BYTES = 64 * 1024 * 1024
_BASE64 = re.compile(rb"[A-Za-z0-9+/]*={0,2}")  # what b64decode(validate=True) accepts


def b64encode(data: bytes) -> bytes:
    """``base64.b64encode``: that module (with ``struct``) costs every sandbox 0.2 MiB at
    start for two calls of the C functions in ``binascii``."""
    return binascii.b2a_base64(data, newline=False)


def b64decode(data: bytes) -> bytes:
    """``base64.b64decode(data, validate=True)``: only the alphabet and its padding, or
    ``ValueError`` (``binascii.Error`` is one)."""
    if not _BASE64.fullmatch(data):
        raise ValueError("Non-base64 digit found")
    return binascii.a2b_base64(data)


def sha256(data: bytes = b"") -> "hashlib._Hash":
    """``hashlib.sha256(data)``, with hashlib imported on first use: it loads OpenSSL's
    libcrypto (3 MiB resident), which an idle sandbox, or one that only runs commands,
    never needs."""
    import hashlib

    return hashlib.sha256(data)


def os_error(exc: OSError, path: str) -> errors.ExecdError:
    """Map an OSError on a user path to the API error it deserves."""
    code = exc.errno
    if code in (errno.ENOENT, errno.ENOTDIR):
        return errors.NotFound("no such file: %s" % path, "file_not_found")
    if code == errno.EISDIR:
        return errors.BadRequest("is a directory: %s" % path, "is_directory")
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return errors.Forbidden("%s: %s" % (os.strerror(code), path), "permission_denied")
    return errors.BadRequest("%s: %s" % (os.strerror(code or 0), path), "os_error")


def _open_regular(path: str) -> Tuple[int, os.stat_result]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO must not block
    except OSError as exc:
        raise os_error(exc, path) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        if stat.S_ISDIR(st.st_mode):
            raise errors.BadRequest("is a directory: %s" % path, "is_directory")
        raise errors.BadRequest("not a regular file: %s" % path, "not_regular_file")
    return fd, st


def _read_all(fd: int) -> bytes:
    chunks: List[bytes] = []
    while True:
        data = os.read(fd, 1 << 20)
        if not data:
            return b"".join(chunks)
        chunks.append(data)


def read_bytes(path: str) -> bytes:
    fd, _ = _open_regular(path)
    try:
        return _read_all(fd)
    finally:
        os.close(fd)


def read_response(path: str) -> Response:
    fd, st = _open_regular(path)
    if st.st_size <= STREAM_OVER:
        try:
            data = _read_all(fd)
        finally:
            os.close(fd)
        return Response(
            200,
            {
                "content_b64": b64encode(data).decode("ascii"),
                "size": len(data),
                "sha256": sha256(data).hexdigest(),
            },
        )
    size = st.st_size
    head = b'{"size":%d,"content_b64":"' % size
    tail_len = len(b'","sha256":""}') + 64
    length = len(head) + 4 * ((size + 2) // 3) + tail_len
    return Response(200, chunks=_stream(fd, size, head), length=length)


def _stream(fd: int, size: int, head: bytes) -> Iterator[bytes]:
    """Base64 pieces of exactly ``size`` bytes; the hash rides at the end."""
    digest = sha256()
    try:
        yield head
        left = size
        while left:
            data = os.read(fd, min(PIECE, left))
            while data and len(data) < min(PIECE, left):  # short reads: fill the piece
                more = os.read(fd, min(PIECE, left) - len(data))
                if not more:
                    break
                data += more
            if not data:
                raise Close()  # the file shrank under us: the promised length is a lie now
            left -= len(data)
            digest.update(data)
            yield b64encode(data)
        yield b'","sha256":"%s"}' % digest.hexdigest().encode()
    finally:
        os.close(fd)


B64_PIECE = 4 * 1024 * 1024  # characters, a multiple of 4


def b64_pieces(text: Union[str, memoryview], field: str = "content_b64") -> Iterator[bytes]:
    """Decode base64 in pieces straight into the file: a 100 MiB upload never
    exists decoded in memory next to its encoded form and an ASCII copy."""
    if len(text) % 4:
        raise errors.BadRequest("field %r is not valid base64 (length)" % field, "invalid_base64")
    for at in range(0, len(text), B64_PIECE):
        chunk = text[at : at + B64_PIECE]
        last = at + B64_PIECE >= len(text)
        try:
            piece = chunk.encode("ascii") if isinstance(chunk, str) else bytes(chunk)
            if not last and b"=" in piece:
                raise ValueError("padding before the end")
            yield b64decode(piece)
        except (ValueError, UnicodeEncodeError):  # binascii.Error is a ValueError
            raise errors.BadRequest(
                "field %r is not valid base64" % field, "invalid_base64"
            ) from None


def write_atomic(
    path: str, data: Union[bytes, Iterable[bytes]], mode: Optional[int], umask: int
) -> Doc:
    """Write ``data`` (bytes, or pieces of it) to ``path`` atomically."""
    if path.endswith("/"):
        raise errors.BadRequest("path names a directory: %s" % path, "is_directory")
    target = os.path.realpath(path) if os.path.islink(path) else path  # write through links
    parent = os.path.dirname(target) or "/"
    try:
        os.makedirs(parent, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise errors.BadRequest("a parent of %s is not a directory" % path, "bad_parent") from None
    except OSError as exc:
        raise os_error(exc, path) from None
    try:
        old = os.stat(target)
    except FileNotFoundError:
        old = None
    except OSError as exc:
        raise os_error(exc, path) from None
    if old is not None and stat.S_ISDIR(old.st_mode):
        raise errors.BadRequest("is a directory: %s" % path, "is_directory")
    if old is not None and not os.access(target, os.W_OK):
        # The rename below would replace a file we may not write; refuse as open(path, "w")
        # does (root with CAP_DAC_OVERRIDE may, exactly as there).
        raise os_error(PermissionError(errno.EACCES, "Permission denied"), path)
    if mode is None:
        mode = stat.S_IMODE(old.st_mode) if old is not None else 0o666 & ~umask
    tmp = os.path.join(
        parent, ".%s.execd-%s.tmp" % (os.path.basename(target)[:64], os.urandom(6).hex())
    )
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise os_error(exc, path) from None
    digest = sha256()
    size = 0
    try:
        try:
            for piece in [data] if isinstance(data, bytes) else data:
                digest.update(piece)
                size += len(piece)
                view = memoryview(piece)
                while view:
                    view = view[os.write(fd, view) :]
            if old is not None:
                with suppress(OSError):
                    os.fchown(fd, old.st_uid, old.st_gid)
            os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, target)
    except OSError as exc:
        with suppress(OSError):
            os.unlink(tmp)
        raise os_error(exc, path) from None
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(parent)
    return {"size": size, "sha256": digest.hexdigest()}


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def edit_file(path: str, old: str, new: str, umask: int) -> Doc:
    fd, st = _open_regular(path)
    try:
        if st.st_size > MAX_EDIT_BYTES:
            raise errors.Unprocessable(
                "file is too large for the editor (%d bytes)%s" % (st.st_size, SHELL_HINT),
                "too_large",
            )
        raw = _read_all(fd)
    finally:
        os.close(fd)
    intended = apply_edit(raw, old, new)
    result = write_atomic(path, intended, stat.S_IMODE(st.st_mode), umask)
    try:
        landed = read_bytes(path)
    except errors.ExecdError:
        landed = b""
    if len(landed) != len(intended) or sha256(landed).hexdigest() != result["sha256"]:
        write_atomic(path, raw, stat.S_IMODE(st.st_mode), umask)
        raise errors.Unprocessable(
            "the edited file could not be verified on disk (length or "
            "SHA-256 differ); the original was put back" + SHELL_HINT,
            "verify_failed",
        )
    return result

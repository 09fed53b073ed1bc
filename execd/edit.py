"""The string-replace editor's pure core: exact bytes in, exact bytes out.

Line endings: a uniformly CRLF file gets the agent's LF text converted to CRLF
(agents write LF); a uniformly LF file gets CRLF text converted to LF. In a
file mixing both, the text must match as given; when it would only match with
endings ignored, the edit is refused with a message saying so instead of
guessing which lines to change.
"""

import re

from . import errors

BOM = b"\xef\xbb\xbf"
_BARE_LF = re.compile(r"(?<!\r)\n")
SHELL_HINT = "; edit it with the shell instead (sed, python, patch)"


def occurrences(text: str, needle: str, limit: int = 1000) -> int:
    """Overlapping occurrences: 'aa' in 'aaa' is ambiguous, so it counts 2."""
    count = 0
    at = text.find(needle)
    while at != -1 and count < limit:
        count += 1
        at = text.find(needle, at + 1)
    return count


def apply_edit(raw: bytes, old: str, new: str) -> bytes:
    if not old:
        raise errors.BadRequest("field 'old' must not be empty", "invalid_field")
    bom = BOM if raw.startswith(BOM) else b""
    try:
        text = raw[len(bom) :].decode("utf-8")
    except UnicodeDecodeError:
        raise errors.Unprocessable(
            "file is not valid UTF-8 text and could not be written back byte-exactly" + SHELL_HINT,
            "not_utf8",
        ) from None
    crlf = text.count("\r\n")
    lf = text.count("\n") - crlf
    if crlf and not lf:
        old, new = _BARE_LF.sub("\r\n", old), _BARE_LF.sub("\r\n", new)
    elif lf and not crlf:
        old, new = old.replace("\r\n", "\n"), new.replace("\r\n", "\n")
    count = occurrences(text, old)
    if count == 0:
        if crlf and lf and "\n" in old:
            loose = old.replace("\r\n", "\n")
            if loose in text.replace("\r\n", "\n"):
                raise errors.Conflict(
                    "the file mixes CRLF (%d) and LF (%d) line endings and 'old' matches only "
                    "if endings are ignored; give 'old' with the file's exact line endings%s"
                    % (crlf, lf, SHELL_HINT),
                    "mixed_line_endings",
                )
        raise errors.Conflict(
            "'old' was not found in the file (it must match exactly, "
            "including whitespace and indentation)",
            "no_match",
        )
    if count > 1:
        raise errors.Conflict(
            "'old' occurs %s times in the file; include more surrounding "
            "lines to make it unique" % ("1000+" if count >= 1000 else count),
            "ambiguous_match",
        )
    at = text.find(old)
    return bom + (text[:at] + new + text[at + len(old) :]).encode("utf-8")

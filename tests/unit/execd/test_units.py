"""Pure-function tests of execd's parts (no daemon)."""

import base64
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.wire import validation
from execd import bashproto, errors, files, records, runspec, sessionstate
from execd.edit import apply_edit, occurrences
from execd.output import BoundedCapture
from execd.validate import parse_json

pytestmark = pytest.mark.unit
EXECD_DIR = Path(__file__).resolve().parents[3] / "execd"
PROPS = settings(max_examples=100, deadline=None)

line_text = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), max_size=12
)


@PROPS
@given(
    lines=st.lists(line_text, min_size=1, max_size=8),
    eol=st.sampled_from(["\n", "\r\n"]),
    bom=st.booleans(),
    final=st.booleans(),
    data=st.data(),
)
def test_edit_preserves_endings_bom_and_final_newline(lines, eol, bom, final, data):
    text = eol.join(lines) + (eol if final else "")
    raw = (b"\xef\xbb\xbf" if bom else b"") + text.encode()
    i = data.draw(st.integers(0, len(lines) - 1))
    old = lines[i]
    new = data.draw(st.lists(line_text, min_size=1, max_size=3))
    new_text = "\n".join(new)  # the agent writes LF
    if not old or occurrences(text, old) != 1:
        with pytest.raises((errors.Conflict, errors.BadRequest)):
            apply_edit(raw, old, new_text)
        return
    out = apply_edit(raw, old, new_text)
    assert out.startswith(b"\xef\xbb\xbf") == bom
    body = out[3:] if bom else out
    # A file without any line ending gives no convention to follow: text is kept as given.
    file_eol = eol if "\n" in text else "\n"
    expected = text.replace(old, new_text.replace("\n", file_eol), 1)
    assert body.decode() == expected
    if file_eol == "\r\n":
        assert body.count(b"\n") == body.count(b"\r\n")  # still uniformly CRLF
    if i < len(lines) - 1 and text.find(old) + len(old) < len(text.rstrip("\r\n")):
        assert body.endswith(eol.encode()) == text.endswith(eol)  # the end is untouched


@PROPS
@given(raw=st.binary(max_size=64), old=st.text(min_size=1, max_size=4), new=st.text(max_size=4))
def test_edit_is_exact_replace_or_refusal(raw, old, new):
    try:
        out = apply_edit(raw, old, new)
    except (errors.Conflict, errors.Unprocessable):
        return
    text = raw.decode("utf-8")  # accepted input is valid UTF-8 (after an optional BOM)
    assert out != raw or old == new or occurrences(text, old) == 1


def test_edit_refuses_non_utf8():
    with pytest.raises(errors.Unprocessable, match="shell"):
        apply_edit(b"\xff\xfe", "a", "b")


def test_edit_lf_text_in_crlf_file():
    assert apply_edit(b"a\r\nb\r\n", "a\nb\n", "c\n") == b"c\r\n"


def test_edit_crlf_text_in_lf_file():
    assert apply_edit(b"a\nb\n", "a\r\nb", "x\r\ny") == b"x\ny\n"


def test_occurrences_counts_overlaps():
    assert occurrences("aaa", "aa") == 2 and occurrences("abc", "d") == 0


@PROPS
@given(chunks=st.lists(st.binary(max_size=300), max_size=20), cap=st.integers(0, 500))
def test_capture_keeps_head_and_tail_and_true_count(chunks, cap):
    c = BoundedCapture(cap)
    for chunk in chunks:
        c.feed(chunk)
    data = b"".join(chunks)
    assert c.total == len(data)
    assert c.truncated == (len(data) > cap)
    if not c.truncated:
        assert c.raw() == data
    else:
        assert c.raw() == data[: cap // 2] + data[len(data) - (cap - cap // 2) :]
        assert "bytes omitted" in c.text()


@settings(max_examples=30, deadline=None)
@given(
    value=st.text(
        st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=40
    )
)
def test_quote_roundtrips_through_bash(value):
    out = subprocess.run(
        ["bash", "--norc", "-c", "printf %s " + bashproto.quote(value)],
        capture_output=True,
        check=True,
    ).stdout
    assert out.decode() == value


@pytest.mark.parametrize("body", [b"[]", b"1", b"{", b"\xff", b"[" * 50000])
def test_parse_json_refusals(body):
    with pytest.raises(errors.BadRequest):
        parse_json(body)


def test_parse_json_empty_is_empty_object():
    assert parse_json(b"") == {} and parse_json(b' {"a": 1} ') == {"a": 1}


def test_execd_is_python38_compatible():
    beside = Path(sys.executable).parent / "vermin"  # the venv's, even if not on PATH
    vermin = str(beside) if beside.exists() else shutil.which("vermin")
    if vermin is None:
        pytest.fail("vermin is not installed (it is in the dev extra)")
    res = subprocess.run(
        [vermin, "-t=3.8-", "--no-tips", "--violations", "--eval-annotations", str(EXECD_DIR)],
        check=False,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_parse_declare_keeps_bash_quoting():
    text = (
        'declare -x A="1"\ndeclare -x B="multi\nline \\"q\\" \\$x \\\\ \\`"\n'
        "declare -x C=$'a\\nb\\'c\\377'\n"
        'declare -x EMPTY=""\ndeclare -x NOVAL\ndeclare -rx RO="r"\n'
    )
    assert sessionstate.parse_declare(text) == {
        "A": '"1"',
        "B": '"multi\nline \\"q\\" \\$x \\\\ \\`"',
        "C": "$'a\\nb\\'c\\377'",
        "EMPTY": '""',
        "RO": '"r"',
    }


@pytest.mark.parametrize(
    "name", ["LD_PRELOAD", "SANDMAN_X", "PYTHONPATH", "BASH_ENV", "IFS", "PATH", "HOME", "A"]
)
def test_run_env_refuses_what_the_acquire_env_refuses(name):
    """execd cannot import the broker's list, so the two are kept equal here."""
    assert runspec.reserved(name) == validation.reserved_env_name(name)
    assert runspec.RESERVED_ENV == validation._RESERVED_ENV
    assert runspec.RESERVED_PREFIXES == validation._RESERVED_ENV_PREFIXES


class _Point(records.NamedTuple):
    """A doc."""

    x: int
    y: str = "b"

    def both(self) -> str:
        return f"{self.x}{self.y}"


def test_records_namedtuple_is_what_typings_would_be():
    p = _Point(1)
    assert (p, p.both(), _Point(2, y="c")) == ((1, "b"), "1b", (2, "c"))
    assert _Point._fields == ("x", "y") and _Point.__doc__ == "A doc."
    assert p._replace(y="z") == _Point(1, "z") and isinstance(p, tuple)
    assert repr(p) == "_Point(x=1, y='b')" and _Point.__module__ == __name__
    with pytest.raises(TypeError):
        _Point()
    with pytest.raises(TypeError, match="without a default follows"):

        class _Bad(records.NamedTuple):
            a: int = 1
            b: int


@PROPS
@given(data=st.binary(max_size=64))
def test_b64_helpers_match_the_base64_module(data):
    encoded = base64.b64encode(data)
    assert files.b64encode(data) == encoded
    assert files.b64decode(encoded) == data


@pytest.mark.parametrize("bad", [b"YQ=", b"YWJj!", b"YW Jj", b"YQ===", b"=YWJ", b"\xffYQ=="])
def test_b64decode_refuses_what_validate_true_refuses(bad):
    with pytest.raises(ValueError):
        base64.b64decode(bad, validate=True)
    with pytest.raises(ValueError):
        files.b64decode(bad)


def test_suppress_swallows_only_what_it_names():
    with errors.suppress(OSError):
        raise FileNotFoundError("a subclass is swallowed")
    with pytest.raises(KeyError), errors.suppress(OSError, ValueError):
        raise KeyError("another is not")
    with errors.suppress(OSError):
        done = True
    assert done

"""Reference splitting and pinning, and reading the kubelet's pull events."""

from __future__ import annotations

import pytest

from broker.backends.kube.pulls import go_duration_s, pull_from_events
from broker.images import refs

pytestmark = pytest.mark.unit
D = "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    ("ref", "parts"),
    [
        ("python:3.12", ("docker.io", "library/python", "3.12")),
        ("localhost/sandman-task-base:v1", ("localhost", "sandman-task-base", "v1")),
        ("127.0.0.1:5000/team/img", ("127.0.0.1:5000", "team/img", "latest")),
        (f"ghcr.io/o/r:tag@{D}", ("ghcr.io", "o/r", D)),
        (f"localhost/x@{D}", ("localhost", "x", D)),
    ],
)
def test_split_names_the_distribution_api_parts(ref: str, parts: tuple[str, str, str]) -> None:
    assert refs.split(ref) == parts


@pytest.mark.parametrize(
    ("ref", "pinned"),
    [
        ("localhost/x:v1", f"localhost/x@{D}"),
        ("127.0.0.1:5000/x", f"127.0.0.1:5000/x@{D}"),
        (f"localhost/x:v1@{'sha256:' + 'cd' * 32}", f"localhost/x@{D}"),
        ("python", f"python@{D}"),
    ],
)
def test_pinned_drops_the_tag_and_keeps_the_spelling(ref: str, pinned: str) -> None:
    assert refs.pinned(ref, D) == pinned


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("2.5s", 2.5), ("512ms", 0.512), ("1m3.5s", 63.5), ("1h2m", 3720.0), ("7µs", 7e-6)],
)
def test_go_durations(text: str, seconds: float) -> None:
    assert go_duration_s(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "2.5", "s", "2.5s trailing", "abc"])
def test_not_go_durations(text: str) -> None:
    assert go_duration_s(text) is None


def _event(reason: str, message: str) -> dict[str, str]:
    return {"reason": reason, "message": message}


def test_a_pull_event_gives_its_duration() -> None:
    events = [
        _event("Scheduled", "Successfully assigned ns/p to node"),
        _event("Pulling", 'Pulling image "localhost/x@sha256:..."'),
        _event(
            "Pulled",
            'Successfully pulled image "localhost/x@sha256:..." in 1m2.25s '
            "(1m2.5s including waiting). Image size: 74123456 bytes.",
        ),
        _event("Created", "Created container: sandbox"),
    ]
    assert pull_from_events(events) == (True, pytest.approx(62.25))


def test_an_image_already_present_is_no_pull() -> None:
    events = [
        _event("Pulled", 'Container image "localhost/x@sha256:..." already present on machine'),
    ]
    assert pull_from_events(events) == (False, 0.0)


def test_no_pull_event_says_nothing() -> None:
    assert pull_from_events([_event("Scheduled", "assigned")]) == (None, None)
    assert pull_from_events([]) == (None, None)

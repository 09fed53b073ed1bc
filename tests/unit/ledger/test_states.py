import itertools

import pytest

from broker.ledger.states import ALLOWED, TERMINAL_STATES, State, can_transition

pytestmark = pytest.mark.unit


def test_happy_path_is_allowed():
    path = [State.REQUESTED, State.CREATING, State.READY, State.RELEASING, State.DELETED]
    for a, b in itertools.pairwise(path):
        assert can_transition(a, b)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (State.REQUESTED, State.READY),
        (State.DELETED, State.CREATING),
        (State.READY, State.DELETED),
        (State.CREATING, State.DELETED),
        (State.ABANDONED, State.READY),
    ],
)
def test_illegal_jumps_are_refused(a, b):
    assert not can_transition(a, b)


def test_every_state_is_covered_and_deleted_is_terminal():
    assert set(ALLOWED) == set(State)
    for s in TERMINAL_STATES:
        assert ALLOWED[s] == frozenset()
    # Every live state can reach deletion, so no row can be stranded.
    for start in State:
        seen, todo = set(), [start]
        while todo:
            s = todo.pop()
            if s in seen:
                continue
            seen.add(s)
            todo.extend(ALLOWED[s])
        assert State.DELETED in seen

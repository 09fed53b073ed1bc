"""The sandbox state machine. Every jump not listed here is illegal.

    requested ─► creating ─► ready ─► releasing ─► deleted
        │            │  │       │         ▲  ▲
        │            │  │       └► abandoned ┘  │
        │            │  └────────────────────────┘ (caller gave up / budget expired:
        │            ▼                               the provider still owns the pod)
        └────────► failed ──► releasing (a pod may exist: delete it and confirm)

``failed`` is terminal only once no pod can exist for the row; the GC moves failed rows
that still have a pod to ``releasing``. ``deleted`` is terminal.
"""

from __future__ import annotations

import enum

from broker.wire.roles import Role  # re-exported: one definition for both sides

__all__ = [
    "ALLOWED",
    "CAPPED_STATES",
    "LIVE_STATES",
    "TERMINAL_STATES",
    "Role",
    "State",
    "can_transition",
]


class State(enum.StrEnum):
    REQUESTED = "requested"
    CREATING = "creating"
    READY = "ready"
    RELEASING = "releasing"
    DELETED = "deleted"
    FAILED = "failed"
    ABANDONED = "abandoned"


ALLOWED: dict[State, frozenset[State]] = {
    State.REQUESTED: frozenset({State.CREATING, State.FAILED, State.RELEASING}),
    State.CREATING: frozenset({State.READY, State.RELEASING, State.FAILED}),
    State.READY: frozenset({State.RELEASING, State.ABANDONED}),
    State.ABANDONED: frozenset({State.RELEASING}),
    State.FAILED: frozenset({State.RELEASING}),
    State.RELEASING: frozenset({State.DELETED}),
    State.DELETED: frozenset(),
}

# States in which a pod may exist and the ledger is responsible for it.
LIVE_STATES = frozenset(
    {State.REQUESTED, State.CREATING, State.READY, State.RELEASING, State.ABANDONED, State.FAILED}
)
TERMINAL_STATES = frozenset({State.DELETED})
# What a job's live-pod cap counts: every live state except `failed`, a row that never got
# (or never owned) a pod and stays failed for good. Intents count, so rows admitted under
# the cap cannot pile up behind the pacer.
CAPPED_STATES = LIVE_STATES - {State.FAILED}


def can_transition(current: State, target: State) -> bool:
    return target in ALLOWED[current]

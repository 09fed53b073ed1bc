"""What a sandbox is for: a role travels in every acquire request and every lease.

It lives on the wire (not in the ledger) because the trainer client names it and must
not import the ledger; ``broker.ledger.states`` re-exports it so servers and clients
share one definition.
"""

from __future__ import annotations

import enum


class Role(enum.StrEnum):
    ROLLOUT = "rollout"
    GRADING = "grading"

"""The local backend's egress policy as data: allow-lists, the per-job guard, the rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.backends import localnet
from broker.errors import GuardMissing

pytestmark = pytest.mark.unit


def test_networks_are_normalised_sorted_and_deduplicated() -> None:
    got = localnet.networks(["10.1.2.3/8", " 192.0.2.7/32", "10.0.0.0/8"])
    assert got == ("10.0.0.0/8", "192.0.2.7/32")


@pytest.mark.parametrize("entry", ["not-a-cidr", "10.0.0.0/33", "2001:db8::/32", ""])
def test_an_entry_the_uplink_cannot_honour_is_refused(entry: str) -> None:
    with pytest.raises(GuardMissing):
        localnet.networks([entry])


def test_the_ruleset_accepts_loopback_and_the_list_then_refuses_the_rest() -> None:
    rules = localnet.ruleset(("192.0.2.0/24",)).splitlines()
    assert rules[:4] == [
        "*filter",
        ":INPUT ACCEPT [0:0]",
        ":FORWARD DROP [0:0]",
        ":OUTPUT DROP [0:0]",
    ]
    accepts = [r for r in rules if r.endswith("-j ACCEPT")]
    assert accepts == ["-A OUTPUT -o lo -j ACCEPT", "-A OUTPUT -d 192.0.2.0/24 -j ACCEPT"]
    assert rules.index(accepts[-1]) < rules.index("-A OUTPUT -j REJECT") < rules.index("COMMIT")


def test_a_job_gets_what_its_guard_says_and_nothing_without_one(tmp_path: Path) -> None:
    guards = localnet.Guards(tmp_path)
    assert guards.egress("ns", "open", denied=False) == localnet.OPEN_EGRESS
    assert guards.egress("ns", "unguarded", denied=True) == localnet.NO_EGRESS
    guards.ensure("ns", "sealed", [])
    assert guards.has("ns", "sealed")
    assert guards.egress("ns", "sealed", denied=True) == localnet.NO_EGRESS
    guards.ensure("ns", "listed", ["192.0.2.9/32"])
    assert guards.egress("ns", "listed", denied=True) == localnet.Egress(True, ("192.0.2.9/32",))
    (tmp_path / ".egress" / "ns.listed.json").write_text("{not json")
    assert guards.egress("ns", "listed", denied=True) == localnet.NO_EGRESS, "fail closed"

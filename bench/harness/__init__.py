"""Test and campaign tooling that ships with the broker (fault proxy, trial harness)."""

"""The two-transport trainer fixture of the client tests, and a broker of its own for the
crash tests, shared here."""

from tests.integration.client.test_transports import make_trainer
from tests.support.ownbroker import own_broker

__all__ = ["make_trainer", "own_broker"]

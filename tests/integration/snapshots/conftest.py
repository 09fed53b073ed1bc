"""The two-transport trainer fixture of the client tests, shared here."""

from tests.integration.client.test_transports import make_trainer

__all__ = ["make_trainer"]

"""A broker of its own (tests.support.ownbroker) for tests that restart services or kill
workers."""

from tests.support.ownbroker import OwnBroker, own_broker

__all__ = ["OwnBroker", "own_broker"]

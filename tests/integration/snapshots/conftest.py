"""The snapshot tests run against both blob stores: every module's ``stack`` (a real
worker) is built twice, once on the state dir's filesystem and once on a real S3 server
on loopback (``s3_server``: versitygw), each in a prefix of its own; the two-transport
trainer fixture of the client tests, and a broker of its own for the crash tests, are
shared here."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from broker.settings import Settings
from tests.integration.client.test_transports import make_trainer
from tests.integration.conftest import broker_stack
from tests.support.blobstores import STORES, store_fields
from tests.support.ownbroker import own_broker

__all__ = ["make_trainer", "own_broker"]


@pytest.fixture(scope="module", params=STORES)
def stack(
    request: pytest.FixtureRequest,
    database_url: str,
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Settings]:
    extra = store_fields(request, f"stack-{secrets.token_hex(4)}")
    with broker_stack(database_url, redis_url, tmp_path_factory, **extra) as settings:
        yield settings

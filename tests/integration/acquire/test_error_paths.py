"""A worker that loses PostgreSQL or Redis mid-acquire answers ServiceUnavailable, not a
generic "unexpected" InfrastructureError (found by the system fault campaign's restart_pg)."""

from __future__ import annotations

import psycopg
import pytest
import redis
import sqlalchemy
from sqlalchemy.exc import OperationalError

from broker.acquire.service import error_payload
from broker.errors import InfrastructureError, ServiceUnavailable
from broker.wire.errors import raise_payload_error

pytestmark = pytest.mark.integration


def test_real_postgres_refusal_is_service_unavailable() -> None:
    engine = sqlalchemy.create_engine("postgresql+psycopg://u:secret-pw@127.0.0.1:1/x")
    with pytest.raises(OperationalError) as info:
        engine.connect()
    payload = error_payload(info.value)
    assert payload["error"]["type"] == "ServiceUnavailable"
    assert payload["error"]["code"] == "service_unavailable"
    assert "secret-pw" not in payload["error"]["message"]
    with pytest.raises(ServiceUnavailable):
        raise_payload_error(payload)


def test_real_redis_refusal_is_service_unavailable() -> None:
    with pytest.raises(redis.ConnectionError) as info:
        redis.Redis(port=1, socket_connect_timeout=1).ping()
    assert error_payload(info.value)["error"]["type"] == "ServiceUnavailable"


def test_other_unexpected_errors_stay_infrastructure_errors() -> None:
    payload = error_payload(KeyError("x"))
    assert payload["error"]["code"] == "infrastructure_error"
    with pytest.raises(InfrastructureError):
        raise_payload_error(payload)
    assert psycopg  # the driver under test

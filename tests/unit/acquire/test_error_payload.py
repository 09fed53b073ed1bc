"""What a trainer learns of a worker-side failure: typed messages, never an untyped one's text."""

from __future__ import annotations

import pytest

from broker.acquire.service import error_payload
from broker.errors import CreateFailed, InfrastructureError, InvalidRequest, QuotaExceeded
from broker.ledger.db import make_engine
from broker.wire.errors import raise_payload_error

pytestmark = pytest.mark.unit

STATEMENT = "INSERT INTO sandboxes (id, nonce, token_hash) VALUES ('s-1', 'n0nce-secret', 'h4sh')"


def test_an_untyped_error_reaches_the_trainer_as_a_generic_message() -> None:
    payload = error_payload(RuntimeError(STATEMENT), "r-42")
    message = payload["error"]["message"]
    assert "INSERT" not in message and "n0nce-secret" not in message and "h4sh" not in message
    assert "r-42" in message  # enough to find the worker log line
    assert payload["error"]["type"] == "InfrastructureError"
    with pytest.raises(InfrastructureError):
        raise_payload_error(payload)


def test_a_typed_error_keeps_its_own_message() -> None:
    payload = error_payload(CreateFailed("image pull failed"))
    assert payload["error"] == {
        "code": "create_failed",
        "message": "image pull failed",
        "type": "CreateFailed",
    }


def test_the_engine_keeps_bound_parameters_out_of_error_text() -> None:
    engine = make_engine("postgresql+psycopg://u:p@127.0.0.1:1/x")
    assert engine.hide_parameters
    engine.dispose()


def test_a_worker_side_invalid_request_names_its_field_in_the_trainer() -> None:
    payload = error_payload(InvalidRequest("base_commit too long", field="base_commit"))
    with pytest.raises(InvalidRequest) as info:
        raise_payload_error(payload)
    assert info.value.field == "base_commit"


def test_a_quota_refusal_reaches_the_trainer_with_its_tenant_quota_and_wait() -> None:
    payload = error_payload(
        QuotaExceeded("over", tenant="vision", quota="creates_per_minute", retry_after=12.5)
    )
    assert payload["error"]["retry_after"] == 12.5 and payload["error"]["tenant"] == "vision"
    with pytest.raises(QuotaExceeded) as info:
        raise_payload_error(payload)
    exc = info.value
    assert (exc.tenant, exc.quota, exc.retry_after_s) == ("vision", "creates_per_minute", 12.5)
    assert exc.retryable and isinstance(exc, InfrastructureError)


def test_wire_details_of_the_wrong_type_or_class_are_dropped() -> None:
    payload = {
        "error": {
            "code": "quota_exceeded",
            "message": "over",
            "retry_after": "soon",
            "tenant": 7,
            "field": "x",  # QuotaExceeded has no field
        }
    }
    with pytest.raises(QuotaExceeded) as info:
        raise_payload_error(payload)
    assert (info.value.retry_after_s, info.value.tenant) == (None, None)
    assert not hasattr(info.value, "field")

"""Choosing the snapshot store from settings, and how S3 failures become typed errors.

The error mapping is checked on botocore's own exception objects (the seam the store
catches at); the store itself runs against a real S3 server in the integration tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import botocore.exceptions as bce
import pytest

from broker.errors import ConfigError, ServiceUnavailable
from broker.settings import Settings, parse_snapshot_store
from broker.snapshots.s3store import S3BlobStore
from broker.snapshots.store import FsBlobStore, open_store

pytestmark = pytest.mark.unit

SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
ACCESS = "AKIAIOSFODNN7EXAMPLE"


@pytest.mark.parametrize(
    ("raw", "parsed"),
    [
        ("", None),
        ("s3://snaps", ("snaps", "")),
        ("s3://snaps/", ("snaps", "")),
        ("s3://snaps/team-a/prod/", ("snaps", "team-a/prod/")),
        ("s3://my.bucket-1/p", ("my.bucket-1", "p/")),
    ],
)
def test_the_store_setting_parses(raw: str, parsed: tuple[str, str] | None) -> None:
    assert parse_snapshot_store(raw) == parsed


@pytest.mark.parametrize(
    "raw", ["/var/snaps", "s3:///p", "s3://Upper/p", "gs://b/p", "s3://b/p?x=1", "s3://a"]
)
def test_other_store_settings_are_refused_at_startup(raw: str) -> None:
    with pytest.raises(ConfigError, match="SANDMAN_SNAPSHOT_STORE"):
        Settings(snapshot_store=raw)


def test_s3_settings_are_checked_and_their_keys_never_printed() -> None:
    with pytest.raises(ConfigError, match="go together"):
        Settings(snapshot_s3_access_key=ACCESS)
    with pytest.raises(ConfigError, match="ENDPOINT"):
        Settings(snapshot_s3_endpoint="127.0.0.1:9000")
    settings = Settings.from_env(
        {
            "SANDMAN_SNAPSHOT_STORE": "s3://snaps/p",
            "SANDMAN_SNAPSHOT_S3_ENDPOINT": "http://127.0.0.1:9000",
            "SANDMAN_SNAPSHOT_S3_ACCESS_KEY": ACCESS,
            "SANDMAN_SNAPSHOT_S3_SECRET_KEY": SECRET,
        }
    )
    shown = repr(settings.redacted())
    assert ACCESS not in shown and SECRET not in shown and "s3://snaps/p" in shown


def test_the_factory_builds_the_store_the_settings_name(tmp_path: Path) -> None:
    assert isinstance(open_store(Settings(state_dir=tmp_path)), FsBlobStore)
    s3 = open_store(
        Settings(
            state_dir=tmp_path,
            snapshot_store="s3://snaps/team",
            snapshot_s3_endpoint="http://127.0.0.1:9",
            snapshot_s3_access_key=ACCESS,
            snapshot_s3_secret_key=SECRET,
        )
    )
    assert isinstance(s3, S3BlobStore)
    assert (s3.bucket, s3.prefix, s3._blob("ab" * 32)) == (
        "snaps",
        "team/",
        "team/blobs/ab/" + "ab" * 32,
    )
    assert s3.client.meta.endpoint_url == "http://127.0.0.1:9"


def _client_error(code: str, status: int, message: str = "") -> bce.ClientError:
    response: Any = {
        "Error": {"Code": code, "Message": message},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return bce.ClientError(response, "HeadObject")


@pytest.mark.parametrize(
    ("exc", "typed"),
    [
        (_client_error("SlowDown", 503), ServiceUnavailable),
        (_client_error("InternalError", 500), ServiceUnavailable),
        (bce.EndpointConnectionError(endpoint_url="http://127.0.0.1:9"), ServiceUnavailable),
        (bce.ReadTimeoutError(endpoint_url="http://127.0.0.1:9"), ServiceUnavailable),
        (_client_error("AccessDenied", 403), ConfigError),
        (_client_error("NoSuchBucket", 404), ConfigError),
        (bce.NoCredentialsError(), ConfigError),
    ],
)
def test_s3_failures_are_typed(exc: Exception, typed: type[Exception]) -> None:
    store = S3BlobStore(object(), "snaps", "p/")  # type: ignore[arg-type]
    err = store._failure(exc, "HEAD", "p/blobs/ab/x")
    assert type(err) is typed, err
    assert "s3://snaps/p/blobs/ab/x" in str(err)


def test_a_server_message_that_echoes_a_key_is_scrubbed() -> None:
    store = S3BlobStore(object(), "snaps", scrub=(ACCESS, SECRET))  # type: ignore[arg-type]
    err = store._failure(
        _client_error("InvalidAccessKeyId", 403, f"key {ACCESS} unknown; tried {SECRET}"),
        "PUT",
        "k",
    )
    assert ACCESS not in str(err) and SECRET not in str(err) and "***" in str(err)
    assert "InvalidAccessKeyId" in str(err)

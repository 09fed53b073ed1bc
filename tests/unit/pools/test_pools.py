"""Pool keys and pool configuration parsing (pure)."""

from __future__ import annotations

import pytest

from broker.cli.run import parse_warm
from broker.errors import InvalidRequest
from broker.pools.store import PoolConfig, parse_pools, pool_key

pytestmark = pytest.mark.unit


def test_pool_key_separates_what_makes_sandboxes_incompatible() -> None:
    base = pool_key("img:1", None, "abc", 500, 1 << 29)
    assert base == pool_key("img:1", None, "abc", 500, 1 << 29)
    assert base != pool_key("img:1", None, "abd", 500, 1 << 29)
    assert base != pool_key("img:1", None, "abc", 1000, 1 << 29)
    assert base != pool_key("img:1", None, "abc", 500, 1 << 30)
    digest = "sha256:" + "a" * 64
    # The digest, not the tag, names the bytes.
    assert pool_key("img:1", digest, None, 1, 1) == pool_key("img:2", digest, None, 1, 1)


def test_pool_config_defaults_and_validation() -> None:
    cfg = PoolConfig.parse({"image": "python:3.12", "size": 3, "cpu": "500m"}, 300.0)
    assert (cfg.size, cfg.cpu_m, cfg.memory_b, cfg.idle_timeout_s) == (3, 500, 1 << 30, 300.0)
    assert parse_pools(None) == []
    for bad in ({"size": 1}, {"image": "x", "size": -1}, {"image": "x", "idle_timeout_s": 0}):
        with pytest.raises(InvalidRequest):
            PoolConfig.parse(bad)


def test_cli_warm_option() -> None:
    entry = parse_warm("python:3.12=4,cpu=250m,memory=256Mi,idle=60", 300.0)
    assert entry["size"] == 4 and entry["cpu_m"] == 250 and entry["memory_b"] == 256 << 20
    assert entry["idle_timeout_s"] == 60.0
    with pytest.raises(InvalidRequest):
        parse_warm("python:3.12", 300.0)
    with pytest.raises(InvalidRequest):
        parse_warm("python:3.12=1,colour=red", 300.0)


def test_cli_egress_option() -> None:
    from broker.cli.run import parse_egress
    from broker.errors import InvalidRequest

    assert parse_egress("allow") == {"egress": "allow", "egress_allow": []}
    assert parse_egress("deny") == {"egress": "deny", "egress_allow": []}
    assert parse_egress("192.0.2.7,2001:db8::/48") == {
        "egress": "allowlist",
        "egress_allow": ["192.0.2.7/32", "2001:db8::/48"],
    }
    for bad in ("192.0.2.1/24", "deny,192.0.2.0/24", "", "Allow"):
        with pytest.raises(InvalidRequest, match="--egress"):
            parse_egress(bad)

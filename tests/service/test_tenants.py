"""Tenants and quotas of ``noria service`` (``noria.service.tenants``), without a model."""

from __future__ import annotations

import pytest

from noria.config import ServiceSection
from noria.errors import NoriaError
from noria.service.tenants import WINDOW_S, QuotaExceeded, load_tenants


def registry(tmp_path, text: str, name: str = "keys.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return load_tenants(ServiceSection(keys_file=str(path), queue_depth=2, tokens_per_minute=100))[0]


def test_queue_depth_and_token_window(tmp_path):
    reg = registry(tmp_path, "tenants:\n  a: {key: tml-aaaaaaaaaaaaaaaa}\n  b: {key: tml-bbbbbbbbbbbbbbbb, queue_depth: 5}\n")
    a, b = reg.tenants["a"], reg.tenants["b"]
    reg.admit(a, 10, now=0.0)
    reg.admit(a, 10, now=1.0)
    with pytest.raises(QuotaExceeded, match="queue_depth is 2") as err:
        reg.admit(a, 10, now=2.0)
    assert err.value.retry_after_s >= 1
    reg.admit(b, 10, now=2.0)  # another tenant's queue is its own
    reg.done(a)
    with pytest.raises(QuotaExceeded, match="tokens_per_minute 100") as err:
        reg.admit(a, 85, now=10.0)  # 20 in the window + 85 > 100: fits once the first 10 has left it
    assert err.value.retry_after_s == pytest.approx(WINDOW_S - 10.0)
    reg.admit(a, 85, now=WINDOW_S + 0.5)


def test_keys_authenticate_their_tenant_only(tmp_path):
    reg = registry(tmp_path, '{"tenants": {"a": {"key": "tml-aaaaaaaaaaaaaaaa"}}}', "keys.json")
    assert reg.authenticate("tml-aaaaaaaaaaaaaaaa").name == "a"
    assert reg.authenticate("tml-aaaaaaaaaaaaaaab") is None
    reg2, key = load_tenants(ServiceSection())
    assert key.startswith("tml-") and reg2.authenticate(key).name == "default"


@pytest.mark.parametrize(
    "text, message",
    [
        ("tenants:\n  a: {key: short}\n", "tenants.a: needs 'key'"),
        ("tenants:\n  a: {key: tml-aaaaaaaaaaaaaaaa, queue_depht: 3}\n", "unknown fields \\['queue_depht'\\]"),
        ("tenants:\n  a: {key: tml-aaaaaaaaaaaaaaaa, max_adapters: 0}\n", "tenants.a.max_adapters: must be an integer >= 1"),
        ("tenants:\n  a: {key: tml-aaaaaaaaaaaaaaaa}\n  b: {key: tml-aaaaaaaaaaaaaaaa}\n", "keys must be unique"),
        ("tenants: []\n", "non-empty mapping"),
        ("tenants:\n  ../up: {key: tml-aaaaaaaaaaaaaaaa}\n", "a tenant's name is letters"),
    ],
)
def test_bad_keys_files_name_the_field(tmp_path, text, message):
    with pytest.raises(NoriaError, match=message):
        registry(tmp_path, text)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--service.placement", "disaggregated", "--service.sampler", "false"], "service.placement: disaggregated .* needs service.sampler: true"),
        (["--service.engine_url", "http://127.0.0.1:30000"], "service.engine_url .* needs service.placement: disaggregated"),
        (["--service.placement", "apart"], "service.placement"),
    ],
)
def test_sampler_placement_errors_name_the_key(overrides, message):
    from noria.service.cli import load_service_config

    with pytest.raises(NoriaError, match=message):
        load_service_config(None, "some-model", overrides)

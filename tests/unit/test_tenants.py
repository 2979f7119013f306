"""The tenants file (queueserve/gateway/tenants.py) read as a stranger may write it, the token
lookup as the gateway does it per request, the gateway's per-tenant limits (quotas.py), and
the worker's per-tenant metric, bounded (worker/metrics.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from queueserve.door.http_errors import ApiError
from queueserve.gateway.quotas import Quotas
from queueserve.gateway.tenants import ANONYMOUS, DEFAULT, Tenant, Tenants, parse_tenants


def scope(authorization: bytes | None) -> dict[str, Any]:
    headers = [] if authorization is None else [(b"authorization", authorization)]
    return {"type": "http", "headers": headers}


GOOD = f"""
[tenants.acme]
token = "tok-acme"
weight = 2.5
max_queued = 10
max_priority = 3

[tenants."globex.eu"]
token_sha256 = "{hashlib.sha256(b"tok-globex").hexdigest()}"
"""


def test_a_file_names_tenants_by_token_or_its_digest() -> None:
    tenants = Tenants(parse_tenants(GOOD))
    acme = tenants.of(scope(b"Bearer tok-acme"))
    assert acme == Tenant("acme", 2.5, 10, 3)
    assert tenants.of(scope(b"bearer tok-globex")) == Tenant("globex.eu")
    for wrong in (None, b"Bearer", b"Bearer ", b"Bearer  tok-acme", b"Basic tok-acme", b"tok"):
        assert tenants.of(scope(wrong)) is None, wrong
    assert tenants.names() == ["acme", "globex.eu"]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[tenants.a]\nweight = 1\n", "exactly one of token and token_sha256"),
        ('[tenants.a]\ntoken = "t"\ntoken_sha256 = "' + "0" * 64 + '"\n', "exactly one"),
        ('[tenants.a]\ntoken = "t"\n[tenants.b]\ntoken = "t"\n', "the same token"),
        ('[tenants."a b"]\ntoken = "t"\n', "tenant name"),
        ('[tenants.a]\ntoken = "t"\nwieght = 2\n', "wieght"),
        ('[tenants.a]\ntoken = "t"\nweight = 0\n', "weight"),
        ('[tenants.a]\ntoken = "t"\nweight = nan\n', "weight"),
        ('[tenants.a]\ntoken = "t"\nmax_queued = 1.5\n', "max_queued"),
        ('[tenants.a]\ntoken = "t"\nmax_priority = 10\n', "max_priority"),
        ('[tenants.a]\ntoken = "t"\nmax_priority = true\n', "max_priority"),
        ('[tenants.a]\ntoken_sha256 = "xyz"\n', "token_sha256"),
        ('[tenants.a]\ntoken = ""\n', "token"),
        ("[tenants]\n", "names no tenant"),
        ('token = "t"\n', "unknown top-level keys"),
        ("[tenants.a\n", "not TOML"),
        ("tenants = 3\n", "names no tenant"),
        ("[tenants]\na = 3\n", "must be a table"),
    ],
)
def test_a_wrong_file_is_refused_saying_where(text: str, says: str) -> None:
    with pytest.raises(ValueError, match="tenants") as raised:
        parse_tenants(text)
    assert says in str(raised.value)


def test_open_and_single_token_gateways() -> None:
    assert Tenants.open().of(scope(None)) is ANONYMOUS
    assert not Tenants.open().required
    single = Tenants.single("s3cret")
    assert single.of(scope(b"Bearer s3cret")) is DEFAULT
    assert single.of(scope(b"Bearer s3cre")) is None
    with pytest.raises(ValueError, match="not both"):
        Tenants.of_options("t", Tenants.open())


def test_reload_takes_a_good_file_and_keeps_the_tenants_when_the_new_one_is_bad(
    tmp_path: Path,
) -> None:
    path = tmp_path / "t.toml"
    path.write_text(GOOD)
    tenants = Tenants.from_file(path)
    path.write_text(GOOD.replace("tok-acme", "tok-acme-2"))
    assert tenants.reload()
    assert tenants.of(scope(b"Bearer tok-acme-2")) is not None
    assert tenants.of(scope(b"Bearer tok-acme")) is None
    for bad in ("[tenants.a]\n", "\xff"):
        path.write_text(bad, encoding="latin-1")
        assert not tenants.reload()
        assert tenants.of(scope(b"Bearer tok-acme-2")) is not None
    path.unlink()
    assert not tenants.reload()


def test_quotas_refuse_the_tenant_past_its_limit_alone_and_release_once() -> None:
    quotas = Quotas()
    small, other = Tenant("small", max_queued=3, max_priority=4), Tenant("other", max_queued=3)
    with pytest.raises(ApiError) as raised:
        quotas.admit(small, 1, 5)
    assert raised.value.status == 403
    quotas.admit(small, 3, 4)
    first = quotas.hold(small, 2)
    with pytest.raises(ApiError) as raised:
        quotas.admit(small, 2, 0)
    assert raised.value.status == 429 and raised.value.headers == {"Retry-After": "1"}
    quotas.admit(small, 1, 0)
    quotas.admit(other, 3, 9)  # another tenant's count is its own
    first.release()
    first.release()  # once
    assert quotas.waiting(small) == 0
    ticket = object()
    job = quotas.hold(small, 3, ticket)
    quotas.job_placed(ticket, "c-1")
    quotas.job_cancelled("c-1")
    assert quotas.waiting(small) == 0 and not job.held
    job.release()  # its ticket ending later changes nothing
    assert quotas.waiting(small) == 0


def test_the_worker_counts_items_per_tenant_with_a_bounded_label_set() -> None:
    pytest.importorskip("prometheus_client")
    from queueserve.worker import metrics as wm

    m = wm.PrometheusMiddleware(registry=wm._prometheus().CollectorRegistry())
    serving = SimpleNamespace(name="s")

    def piece(fields: Any, n: int = 1) -> Any:
        return SimpleNamespace(request=SimpleNamespace(fields=fields), items=[0] * n)

    junk = [None, {}, {"tenant": 3}, {"tenant": "a b"}, {"tenant": "x" * 65}, {"tenant": b"acme"}]
    m._count_tenants(serving, [piece({"tenant": "acme"}, 3), *map(piece, junk)])
    m._count_tenants(serving, [piece({"tenant": f"t{i}"}) for i in range(wm.TENANT_LABELS + 5)])
    counted = {
        s.labels["tenant"]: s.value
        for metric in m.tenant_items.collect()
        for s in metric.samples
        if s.name.endswith("_total")
    }
    assert counted["acme"] == 3
    assert counted[wm.OTHER_KEY] == 6  # t99..t104, and nothing of the junk
    assert len(counted) == wm.TENANT_LABELS + 1

"""The fuzzer's registry (tests/faults/fuzz/surfaces.py) covers everything a stranger can write
that queueserve reads: a key or channel added to ``wire/keys.py``, an entry field added to
``wire/protocol.py``, an optional header field added to ``wire/request.py`` or an HTTP server
added to the worker without a fuzz entry fails here, and so does a layout table in keys.py's
docstring that LAYOUT no longer matches.
The fields of the meta and config hashes and of a worker's record are not listed by hand in the
fuzzer: these tests check that it attacks every field a worker declares, every option the model
has, and every field of a worker's record the dashboard reads, a field added later included.
"""

from __future__ import annotations

import inspect
import random
import re
import sys
from pathlib import Path
from typing import Any

import pytest

import queueserve as qs
from queueserve import tracing
from queueserve.dashboard import board
from queueserve.options import serving_options as model
from queueserve.options import stored as stored_options
from queueserve.options.serving_options import RUNTIME, ServingOptions
from queueserve.wire import keys as key_layout
from queueserve.wire import protocol
from queueserve.wire.figures import field_of
from queueserve.wire.key_rules import META_FIELD as KEY_RULE
from queueserve.wire.keys import LAYOUT, Keys
from queueserve.wire.protocol import ENTRY_FIELDS
from queueserve.wire.request import FIELDS
from tests.faults.fuzz import surfaces
from tests.faults.fuzz.surfaces import SURFACES, Target
from tests.faults.fuzz.values import FAMILIES, WRONG_TYPE

PACKAGE = Path(protocol.__file__).resolve().parents[1]
LUA = PACKAGE / "broker" / "lua"

# A row of the docstring's table: "    P:{S}:in:K        stream   requests of ..."
_ROW = re.compile(
    r"^ {4}P:(?:\{S\}:)?([A-Za-z]+)\S*\s+(stream|zset|hash|set|string|channel|list)\s",
    re.MULTILINE,
)
# A field of an entry in the docstring: "    r  present on the entries split.lua makes ..."
_ENTRY_FIELD = re.compile(r"^ {4}([a-z]) {2}\S", re.MULTILINE)
# An XADD of a Lua script, to the end of its call: "redis.call('XADD', KEYS[1], '*', 'h', ..."
_XADD = re.compile(r"'XADD',[^\n]*(?:,\n[^\n]*)*")


def documented_layout() -> list[tuple[str, str]]:
    assert key_layout.__doc__ is not None
    return _ROW.findall(key_layout.__doc__)


def documented_entry_fields() -> set[str]:
    """The fields the docstring gives a request or pack entry."""
    assert protocol.__doc__ is not None
    return set(_ENTRY_FIELD.findall(protocol.__doc__))


def lua_entry_fields() -> set[str]:
    """The field names the Lua scripts XADD (one letter each: h, p, a, k, r)."""
    found = set()
    for script in LUA.glob("*.lua"):
        for call in _XADD.findall(script.read_text()):
            after_id = call.split("'*',", 1)[-1]
            found |= set(re.findall(r"'([a-z])'", after_id))
    return found


def http_servers() -> set[str]:
    """The modules of queueserve that serve HTTP with the standard library (the worker's
    metrics port): ``http.<module>`` each. The gateway and the dashboard have fuzzers of
    their own (tests/faults/test_gateway_fuzz.py, test_dashboard_fuzz.py)."""
    return {
        f"http.{path.stem}"
        for path in PACKAGE.rglob("*.py")
        if re.search(r"^from http\.server import|^import http\.server", path.read_text(), re.M)
    }


def test_the_docstring_table_and_layout_name_the_same_keys_and_types() -> None:
    assert documented_layout() == list(LAYOUT)


def test_every_key_name_keys_builds_is_a_layout_kind() -> None:
    keys = Keys("P", "S")
    built = {
        name
        for name in Keys.__slots__
        if not name.startswith("_")
        and isinstance(getattr(keys, name), str)
        and getattr(keys, name).startswith("P:{S}:")
    }
    assert built <= dict(LAYOUT).keys(), built - dict(LAYOUT).keys()


def test_the_entry_fields_read_from_the_docstring_and_the_scripts_are_found() -> None:
    # (the parsers above: a change of format must not leave them finding nothing)
    assert {"h", "p", "a", "k", "r"} <= documented_entry_fields()
    assert {"h", "p", "a", "k", "r"} <= lua_entry_fields()
    assert http_servers() == {"http.metrics_server"}


def test_every_layout_kind_entry_field_header_field_and_http_server_has_a_fuzz_surface() -> None:
    entry_fields = {*ENTRY_FIELDS, *documented_entry_fields(), *lua_entry_fields()}
    wanted = [
        *(kind for kind, _ in LAYOUT),
        *(f"entry.{f}" for f in sorted(entry_fields)),
        *(f"header.{name}" for name in FIELDS),
        *sorted(http_servers()),
    ]
    registered = [s.kind for s in SURFACES]
    missing = [k for k in wanted if k not in registered]
    assert not missing, (
        f"no fuzz entry in tests/faults/fuzz/surfaces.py for {missing}: add a Surface with "
        "writers of hostile values for it"
    )
    assert sorted(registered) == sorted(wanted), "a surface names nothing queueserve reads"


def test_every_surface_has_attacks_of_known_value_families() -> None:
    for surface in SURFACES:
        assert surface.attacks, surface.kind
        for attack in surface.attacks:
            assert attack.families and set(attack.families) <= {*FAMILIES, WRONG_TYPE}, (
                surface.kind,
                attack.name,
            )


# --- the fields of hashes, from what declares and reads them ---------------------------------
def declared_by_a_worker() -> set[str]:
    """The meta fields a serving and a step serving of this version declare, made here."""
    plain = qs.Serving(lambda xs: xs, name="registry")
    steps = qs.step_serving(prefill=lambda xs: xs, name="registry-steps")(lambda s: s)
    return {*plain.options(), *steps.options()}


def test_the_meta_attack_covers_every_field_a_worker_declares() -> None:
    assert declared_by_a_worker() <= set(surfaces.declared_fields())
    assert set(surfaces.META_SPECIAL) <= set(surfaces.declared_fields()), "stale special cases"


def test_the_config_attack_covers_every_run_time_option_and_every_option() -> None:
    fields = surfaces.config_fields()
    assert set(RUNTIME) <= set(fields)
    assert set(ServingOptions.model_fields) <= set(fields)


def client_reads() -> set[str]:
    """The meta fields something acts on: the options clients parse (options/stored.py), the
    counts enqueue.lua reads, the optional header fields workers read, and the codec."""
    lua = set(re.findall(r"declared_count\('(\w+)'\)", (LUA / "enqueue.lua").read_text()))
    return {*stored_options._DECLARED, *lua, tracing.HEADER_FIELDS, "codec", KEY_RULE}


def test_each_meta_field_acted_on_is_attacked_and_parsed_by_the_model_or_special() -> None:
    reads = client_reads()
    assert {"max_queue", "pack_items", "max_latency", "header_fields"} <= reads  # (found)
    assert reads <= set(surfaces.declared_fields()), "read, and declared by no worker"
    unparsed = {f for f in reads if f not in ServingOptions.model_fields and f != "streaming"}
    assert unparsed <= set(surfaces.META_SPECIAL), (
        f"{unparsed - set(surfaces.META_SPECIAL)}: read without the options model; say in "
        "META_SPECIAL which values of it go in spoilt and why"
    )


def test_the_worker_record_attack_covers_every_field_the_dashboard_reads() -> None:
    source = inspect.getsource(board)
    read = set(re.findall(r"\b(?:record|r)\.get\(\"(\w+)\"", source))
    assert {"host", "device"} <= read  # (found)
    assert {f.encode() for f in read} <= set(surfaces.worker_fields())
    # and a serving's figures, a field named after it (a live worker's are attacked by name)
    assert field_of("fuzz") in surfaces.dashboard_reads()


class _Hashes:
    """The one write a hash attack makes, recorded instead of sent."""

    def __init__(self) -> None:
        self.written: list[tuple[str, str, bytes]] = []

    def hset(self, key: str, name: str, value: bytes) -> None:
        self.written.append((key, name, value))


def written_by(attack: Any, value: bytes, tries: int = 400) -> dict[str, set[bytes]]:
    """Field -> values that ``attack`` wrote, over ``tries`` seeds."""
    r = _Hashes()
    for seed in range(tries):
        attack(Target(r, "P", random.Random(seed)), value)  # type: ignore[arg-type]
    found: dict[str, set[bytes]] = {}
    for _, name, written in r.written:
        found.setdefault(name, set()).add(written)
    return found


def test_an_option_added_to_the_model_is_attacked_in_both_hashes_without_an_edit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given an option added to ServingOptions (and so to Serving.options()) and to RUNTIME
    class Wider(ServingOptions):
        fuzz_new: int = 7

    for module in (sys.modules["queueserve.serving"], model, stored_options):
        monkeypatch.setattr(module, "ServingOptions", Wider)
    monkeypatch.setattr(stored_options, "_FIELDS", Wider.model_fields)
    monkeypatch.setattr(qs.Serving, "fuzz_new", 7, raising=False)
    monkeypatch.setattr(model, "RUNTIME", (*RUNTIME, "fuzz_new"))

    # Then the meta and config attacks write it, and no value the model takes (7 is one)
    meta = written_by(surfaces.meta_field, b"7")
    config = written_by(surfaces.config_field, b"7")
    assert "fuzz_new" in meta and "fuzz_new" in config
    assert b"7" not in meta["fuzz_new"] | config["fuzz_new"]


def test_a_field_added_to_what_a_worker_declares_is_attacked_without_an_edit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    declared = qs.Serving.options
    monkeypatch.setattr(qs.Serving, "options", lambda self: {**declared(self), "fuzz_new": "x"})
    assert "fuzz_new" in written_by(surfaces.meta_field, b"x")


def test_values_a_reader_takes_go_in_spoilt_and_codec_only_on_the_victim() -> None:
    # A value the model takes for each field clients parse, and a count enqueue.lua takes
    taken = {
        "max_payload_bytes": b" 3 ",
        "durable": b"True",
        "batch_key_weights": b"a=2",
        "max_latency": b"5ms",
        "pack_items": b"0",
        KEY_RULE: b"length smallest=2 prefix=k",
    }
    for name, value in taken.items():
        written = written_by(surfaces.meta_field, value, tries=800)
        assert written.get(name) and value not in written[name], (name, written.get(name))
        assert not any(surfaces._taken(name, v) for v in written[name]), (name, written[name])
    assert "codec" not in written_by(surfaces.meta_field, b"msgpack")
    r = _Hashes()
    surfaces.meta_codec(Target(r, "P", random.Random(0)), b"pickle")  # type: ignore[arg-type]
    assert r.written == [(Keys("P", surfaces.VICTIM).meta, "codec", b"pickle")]

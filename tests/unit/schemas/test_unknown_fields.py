"""Request keys that no field reads: found at any depth, with the field a typo most likely meant."""

from __future__ import annotations

import json

import msgpack
import pytest

from schemas import AsrRequest, ChatRequest, RiskRequest, decode_request, unknown_request_fields
from schemas.unknown_fields import MAX_KEY_CHARS, MAX_REPORTED, UnknownField, unknown_fields


def _found(request: dict, fmt: str = "json") -> list[UnknownField]:
    payload = json.dumps(request).encode() if fmt == "json" else msgpack.packb(request)
    return unknown_request_fields(payload, None, decode_request(payload))


CHAT = {"v": 1, "id": "c1", "kind": "chat", "max_tokens": 8, "stop": ["x"], "seed": 3,
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_a_request_with_only_known_fields_has_none(fmt):
    # The tag fields (`kind`, a part's `type`) and the version are fields too.
    assert _found(CHAT, fmt) == []
    assert _found({"id": "r1", "kind": "risk", "labels": ["a"], "items": [{"id": "i", "text": "t"}]}, fmt) == []
    assert _found({"id": "a1", "kind": "asr", "stream_id": "s", "seq": 0, "text": "t"}, fmt) == []


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_typos_and_unsupported_parameters_are_named_at_any_depth(fmt):
    chat = {**CHAT, "max_token": 50, "presence_penalty": 0.5,
            "messages": [{"role": "user", "content": "hi", "nmae": "x"},
                         {"role": "user", "content": [{"type": "text", "txt": "t", "text": "t"}]}]}
    assert _found(chat, fmt) == [  # in the record's order: `messages` came before the two added keys
        UnknownField("messages[0].nmae"), UnknownField("messages[1].content[0].txt", "text"),
        UnknownField("max_token", "max_tokens"), UnknownField("presence_penalty")]
    risk = {"id": "r1", "kind": "risk", "labels": ["a"], "item": [], "items": [{"id": "i", "text": "t", "lable": 1}]}
    assert _found(risk, fmt) == [UnknownField("item", "items"), UnknownField("items[0].lable")]


def test_the_report_stays_small_whatever_the_record_holds():
    chat = {**CHAT, **{f"k{i}": i for i in range(1000)}, "x" * 100_000: 1}
    found = _found(chat)
    assert len(found) == MAX_REPORTED == 8 and found[0].path == "k0"
    long_key = unknown_fields({**CHAT, "é" * 1000 + "\n": 1}, ChatRequest)
    assert len(long_key[0].path) <= MAX_KEY_CHARS + 3 and long_key[0].path.isascii()


def test_a_suggestion_is_described_for_the_sender():
    assert UnknownField("max_token", "max_tokens").describe() == "`max_token` (did you mean `max_tokens`?)"
    assert UnknownField("presence_penalty").describe() == "`presence_penalty`"


def test_every_request_type_is_walked():
    assert unknown_fields({"id": "a", "seq": 0, "stream_id": "s", "text": "t", "final_": True}, AsrRequest) == [
        UnknownField("final_", "final")]
    assert unknown_fields({"id": "r", "labels": [], "items": [], "label": 1}, RiskRequest) == [
        UnknownField("label", "labels")]

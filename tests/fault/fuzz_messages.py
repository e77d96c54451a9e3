"""Hypothesis strategies for bad request records, and how many of each a fuzz run sends.

A strategy draws a `Draft`: which request topic, the body, how to encode it,
its content-type header and key. Bodies that should be answerable carry the
`ID` placeholder where the id goes; `realize` puts a unique id there, so each
error result can be matched to its message. Everything else must come back as
a dead letter, matched by its source offset.

Every near-miss carries at least one mutation that makes it invalid, so the
only `ok` results a run may see are those of the `valid` control messages.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

import msgpack
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

ID = "\x00fuzz-id\x00"

JSON_CT, MSGPACK_CT = b"application/json", b"application/msgpack"
TOPICS = ("chat", "asr", "risk")


@dataclass(frozen=True)
class Draft:
    category: str
    topic: str  # "chat", "asr" or "risk": which request topic it goes to
    body: object  # bytes sent as they are, or a value to encode with `encoding`
    encoding: str  # "raw", "json" or "msgpack"
    content_type: bytes | None
    key: bytes | None = None


def realize(draft: Draft, rid: str) -> tuple[bytes, bool]:
    """The record value, and whether the id placeholder was in it (so an error result is due)."""
    if draft.encoding == "raw":
        return draft.body, False
    if draft.encoding == "json":
        # Raw UTF-8 (lone surrogates passed through as the invalid bytes they are), not \u escapes,
        # which would make a 256 k-character string of emoji 3 MB, past the broker's record limit.
        text = json.dumps(draft.body, allow_nan=True, ensure_ascii=False).encode("utf-8", "surrogatepass")
        placeholder = json.dumps(ID, ensure_ascii=False).encode()
        value = _JSON_DEEP.sub(lambda m: b"[" * int(m[1]) + b"]" * int(m[1]), text.replace(placeholder, json.dumps(rid, ensure_ascii=False).encode()))
        return value, placeholder in text
    packed = msgpack.packb(draft.body, use_bin_type=True, unicode_errors="surrogatepass")
    placeholder = msgpack.packb(ID)
    value = _MSGPACK_DEEP.sub(lambda m: b"\x91" * int(m[1]) + b"\xc0", packed.replace(placeholder, msgpack.packb(rid)))
    return value, placeholder in packed


# Deep nesting is written into the encoded bytes: as Python lists it would overflow the encoders' stack.
_DEEP = "@@deep:{}@@"
_JSON_DEEP = re.compile(rb'"@@deep:(\d+)@@"')
_MSGPACK_DEEP = re.compile(rb"[\xa0-\xbf]@@deep:(\d+)@@")  # a fixstr: its header byte, then the marker


def deep(depth: int) -> str:
    return _DEEP.format(depth)


# ---- building blocks ---------------------------------------------------------------------

content_types = st.sampled_from([None, JSON_CT, MSGPACK_CT, b"text/plain", b"application/json; charset=utf-8",
                                 b"\xff\xfe", b""])
keys = st.none() | st.binary(max_size=16)
# Unicode that tends to break things: controls, NUL, BOM, bidi overrides, zero-width joiners,
# combining marks, non-characters, astral emoji, and lone surrogates (invalid in UTF-8).
nasty_chars = st.sampled_from(["\x00", "\ufeff", "\u202e", "\u200b", "\u200d", "\u0301", "\uffff", "\U0001f600",
                               "\U0001f468\u200d\U0001f469\u200d\U0001f467", "\ud800", "\udfff", "\r\n", "\u2028"])
nasty_text = st.lists(nasty_chars | st.text(max_size=4), max_size=12).map("".join)
not_a_str = st.none() | st.booleans() | st.integers(-5, 5) | st.floats() | st.lists(st.integers(), max_size=3) \
    | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)
not_an_int = st.none() | st.text(max_size=4) | st.floats() | st.lists(st.integers(), max_size=2) | st.booleans()
not_a_list = st.none() | st.text(max_size=8) | st.integers() | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)



def present(value: object) -> bool:
    # A None mutation deletes the field; for a field with a default that leaves the request valid.
    return value is not None


def huge(text_at_least: int = 257) -> st.SearchStrategy[str]:
    # Built from a small draw: Hypothesis cannot draw a 300 kB string directly.
    return st.builds(lambda ch, n: ch * n, st.sampled_from(["x", "é", "\U0001f600", "\u200b"]),
                     st.integers(text_at_least, text_at_least + 1024))


def valid_body(kind: str) -> st.SearchStrategy[dict]:
    """A valid request of `kind` with the id placeholder."""
    if kind == "chat":
        message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                         "content": st.text(max_size=40)})
        return st.fixed_dictionaries({"v": st.just(1), "kind": st.just("chat"), "id": st.just(ID),
                                      "messages": st.lists(message, min_size=1, max_size=3),
                                      "max_tokens": st.integers(1, 4), "temperature": st.just(0.0)})
    if kind == "asr":
        return st.fixed_dictionaries({"v": st.just(1), "kind": st.just("asr"), "id": st.just(ID),
                                      "stream_id": st.uuids().map(str), "seq": st.just(0),
                                      "text": st.text(max_size=40)})
    item = st.fixed_dictionaries({"id": st.uuids().map(str), "text": st.text(max_size=40)})
    return st.fixed_dictionaries({"v": st.just(1), "kind": st.just("risk"), "id": st.just(ID),
                                  "items": st.lists(item, min_size=1, max_size=2, unique_by=lambda i: i["id"]),
                                  "labels": st.just(["low", "high"])})


# Mutations, by kind: (field, strategy of a value that makes the request invalid). None deletes.
_COMMON = [
    ("id", not_a_str | st.just("") | huge(257)),  # no usable id: a dead letter, not an error result
    ("kind", st.text(max_size=12).filter(lambda k: k not in TOPICS) | not_a_str | nasty_text.filter(lambda k: k not in TOPICS)),
    ("kind", st.none()),
    ("v", st.integers(2, 2**40) | st.integers(-(2**40), 0) | not_an_int.filter(present)),
]
_MUTATIONS = {
    "chat": [
        *_COMMON,
        ("messages", not_a_list | st.just([]) | st.builds(deep, st.integers(2, 30_000))),
        ("messages", st.none()),
        ("messages", st.lists(st.fixed_dictionaries({"role": nasty_text.filter(lambda r: r not in ("system", "developer", "user", "assistant", "tool")),
                                                     "content": st.text(max_size=8)}), min_size=1, max_size=2)),
        ("messages", st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": not_a_str}), min_size=1, max_size=2)),
        ("messages", st.builds(lambda c: [{"role": "user", "content": c}], huge(256 * 1024 + 1))),
        ("messages", st.builds(lambda n: [{"role": "user", "content": "a"}] * n, st.integers(1025, 1500))),
        ("max_tokens", st.integers(-(2**63), 0) | st.integers(2**20 + 1, 2**64 - 1) | not_an_int.filter(present)),
        ("temperature", st.sampled_from([math.nan, math.inf, -math.inf, -0.5, 2.01, 1e308]) | not_an_int.filter(lambda v: present(v) and not isinstance(v, float))),
        ("top_p", st.sampled_from([math.nan, math.inf, 0.0, -1.0, 1.5])),
        ("min_p", st.sampled_from([math.nan, -math.inf, 1.01, -0.1])),
        ("top_k", st.integers(-(2**63), -2)),
        ("stop", st.just("") | huge(257) | st.lists(st.text(min_size=1, max_size=4), min_size=17, max_size=20) | st.just([""])),
        ("stream", st.text(max_size=3) | st.integers(2, 9)),
        ("deadline_ms", st.integers(-(2**63), -1) | st.text(max_size=5)),
        ("rules", st.just([""]) | st.lists(st.just("r"), min_size=65, max_size=70) | not_a_list.filter(present)),
        ("tenant", st.just("") | huge(257)),
        ("mask_policy", st.just("") | not_a_str.filter(present)),
    ],
    "asr": [
        *_COMMON,
        ("stream_id", st.just("") | huge(257) | not_a_str),
        ("seq", st.integers(-(2**63), -1) | not_an_int),
        ("text", not_a_str.filter(present) | huge(256 * 1024 + 1) | st.builds(deep, st.integers(2, 30_000))),
        ("final", st.text(max_size=3) | st.integers(2, 9)),
    ],
    "risk": [
        *_COMMON,
        ("items", st.just([]) | not_a_list | st.builds(deep, st.integers(2, 30_000))),
        ("items", st.just([{"id": "a", "text": "x"}, {"id": "a", "text": "y"}])),
        ("items", st.lists(st.fixed_dictionaries({"id": st.just(""), "text": st.text(max_size=4)}), min_size=1, max_size=2)),
        # No labels (or none at all) is valid: the worker's risk.default_labels.
        ("labels", st.just(["a", "a"]) | st.just([""]) | not_a_list.filter(present)),
        ("instruction", huge(256 * 1024 + 1) | not_a_str.filter(present)),
    ],
}


# Built once: a strategy made inside a draw is validated again on every draw, which made
# generation several times slower.
_BODIES = {kind: valid_body(kind) for kind in TOPICS}
_PICK_MUTATION = {kind: st.sampled_from(mutations) for kind, mutations in _MUTATIONS.items()}
_KINDS = st.sampled_from(TOPICS)
_ENCODINGS = st.sampled_from(["json", "msgpack"])
_HOW_MANY = st.integers(1, 3)


@st.composite
def near_misses(draw) -> Draft:
    """A valid request with one to three mutations; every mutation leaves it invalid."""
    kind = draw(_KINDS)
    body = dict(draw(_BODIES[kind]))
    for _ in range(draw(_HOW_MANY)):
        field, values = draw(_PICK_MUTATION[kind])
        value = draw(values)
        if value is None:
            body.pop(field, None)
        else:
            body[field] = value
    encoding = draw(_ENCODINGS)
    if encoding == "msgpack" and not _packable(body):
        encoding = "json"
    # Mostly on its own kind's topic; the worker goes by `kind`, so sometimes on another.
    topic = kind if draw(st.booleans()) else draw(_KINDS)
    return Draft("near_miss", topic, body, encoding, JSON_CT if encoding == "json" else MSGPACK_CT, draw(keys))


def _packable(body: object) -> bool:
    try:
        msgpack.packb(body, use_bin_type=True, unicode_errors="surrogatepass")
    except (OverflowError, ValueError, TypeError):
        return False
    return True


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                           max_leaves=8)
# Maps that lack a string "id" (or have one that cannot key a result) cannot be answered.
no_id_maps = st.dictionaries(st.text(max_size=8).filter(lambda k: k != "id"), json_values, max_size=5)
bad_id_maps = st.builds(lambda m, i, k: {**m, "id": i, **({"kind": k} if k else {})}, no_id_maps,
                        not_a_str | st.just(""), st.sampled_from([None, *TOPICS]))
wrong_shapes = json_values.filter(lambda v: not isinstance(v, dict)) | no_id_maps | bad_id_maps
msgpack_extras = st.recursive(
    st.binary(max_size=12) | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=6)) | json_values,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.integers() | st.binary(max_size=4), inner, max_size=3),
    max_leaves=10)


def _wrong_shape(encoding: str, values) -> st.SearchStrategy[Draft]:
    category = f"wrong_shape_{encoding}"
    ct = st.sampled_from([JSON_CT if encoding == "json" else MSGPACK_CT, None])
    if encoding == "msgpack":
        values = values.filter(_packable)  # msgpack has no integers past 64 bits
    return st.builds(Draft, st.just(category), st.sampled_from(TOPICS), values, st.just(encoding), ct, keys)


random_bytes = st.builds(
    Draft, st.just("random_bytes"), st.sampled_from(TOPICS),
    # Half start like a JSON object or a msgpack map, so they get past sniffing into the decoders.
    st.one_of(st.binary(max_size=512), st.builds(lambda head, tail: head + tail,
                                                  st.sampled_from([b"{", b'{"id":', b"\x81", b"\x82\xa2id", b"\xde\x00\x01"]),
                                                  st.binary(max_size=256))),
    st.just("raw"), content_types, keys)


_FILLERS = st.sampled_from(["z", "ü", "\U0001f600", " word"])


@st.composite
def too_long_prompts(draw, max_seq_len: int = 512) -> Draft:
    """Schema-valid requests whose prompt cannot fit max_seq_len: the handler's prompt_too_long."""
    kind = draw(_KINDS)
    body = dict(draw(_BODIES[kind]))
    filler = draw(nasty_text) + draw(_FILLERS) * draw(st.integers(max_seq_len + 8, 8 * max_seq_len))
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": filler}]
    elif kind == "asr":
        body["text"] = filler
    else:
        body["items"] = [{"id": "long", "text": filler}]
    encoding = draw(_ENCODINGS)
    return Draft("over_max_seq_len", kind, body, encoding, JSON_CT if encoding == "json" else MSGPACK_CT, draw(keys))


def oversized(max_bytes: int) -> st.SearchStrategy[Draft]:
    """Records over the worker's max_message_bytes (below the broker's limit): refused before decoding."""
    size = st.integers(max_bytes + 1, int(max_bytes * 1.9))
    body = st.builds(lambda n, fill: (b'{"v":1,"kind":"chat","id":"big","messages":[{"role":"user","content":"'
                                      + fill * (n // len(fill)) + b'"}]}'), size, st.sampled_from([b"a", b"\\u00e9"]))
    return st.builds(Draft, st.just("oversized"), st.sampled_from(TOPICS), body, st.just("raw"), st.just(JSON_CT), keys)


def valid_controls() -> st.SearchStrategy[Draft]:
    return st.builds(Draft, st.just("valid"), st.just("chat"), _BODIES["chat"], _ENCODINGS, st.none(), st.none())


def quotas(total: int, max_bytes: int, max_seq_len: int) -> list[tuple[st.SearchStrategy[Draft], int]]:
    """The mix of a run of `total` messages (at least one of each category)."""
    shares = [
        (random_bytes, 0.20), (_wrong_shape("json", wrong_shapes), 0.12),
        (_wrong_shape("msgpack", wrong_shapes | msgpack_extras), 0.12), (near_misses(), 0.444),
        (too_long_prompts(max_seq_len), 0.10), (oversized(max_bytes), 0.006), (valid_controls(), 0.01),
    ]
    counts = [max(1, int(total * share)) for _, share in shares]
    counts[3] += total - sum(counts)  # rounding goes to the near misses
    return [(strategy, n) for (strategy, _), n in zip(shares, counts, strict=True)]


def draw_many(strategy: st.SearchStrategy[Draft], n: int, seed_value: int) -> list[Draft]:
    """`n` examples of `strategy`, reproducibly; generation only (there is nothing to shrink)."""
    drafts: list[Draft] = []
    attempt = 0
    while len(drafts) < n and attempt < 20:

        @seed(seed_value * 1000 + attempt)
        @settings(max_examples=n - len(drafts), database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(strategy)
        def collect(draft: Draft) -> None:
            drafts.append(draft)

        collect()
        attempt += 1  # a small strategy can run out of new examples before n
    return drafts[:n]

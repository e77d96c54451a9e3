"""Request records: one flat envelope per message, tagged by `kind`.

Every request carries `v` (schema version) and `id` (the Kafka key of its
result). The `kind` tag picks the rest of the fields. Types here only say the
shape; ranges and limits are checked in `schemas.validation`.

Field names for chat mirror OpenAI chat completions, so a client can pass the
same arguments it would pass to OpenAI.
"""

from __future__ import annotations

import base64
import binascii
from typing import ClassVar

import msgspec

from schemas.version import version_field

# An id longer than this cannot be used to key a result; see SchemaError.
MAX_ID_CHARS = 256

KINDS: tuple[str, ...] = ("chat", "asr", "risk")

# OpenAI's chat roles; "developer" is its newer name for "system".
ROLES: tuple[str, ...] = ("system", "developer", "user", "assistant", "tool")

DEFAULT_MAX_TOKENS = 256


class _RequestBase(msgspec.Struct, tag_field="kind", frozen=True, omit_defaults=True, kw_only=True):
    v: int = version_field()
    id: str


class _Part(msgspec.Struct, tag_field="type", frozen=True, kw_only=True):
    pass


class TextPart(_Part, tag="text", kw_only=True):
    """`{"type": "text", "text": ...}`, as in OpenAI."""

    text: str


class ImageURL(msgspec.Struct, frozen=True, kw_only=True):
    """Only `data:` URLs (`data:image/png;base64,...`) are served: workers never fetch from the network."""

    url: str
    detail: str | None = None  # accepted for OpenAI compatibility; LLaVA has one resolution


class ImageURLPart(_Part, tag="image_url", kw_only=True):
    """`{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`, as in OpenAI."""

    image_url: ImageURL


class ImagePart(_Part, tag="image", kw_only=True):
    """`{"type": "image", "image": <bytes>}`: the encoded file (PNG, JPEG, ...) as msgpack bin, or as a
    base64 string in JSON."""

    image: bytes


ContentPart = TextPart | ImageURLPart | ImagePart


def image_data(part: ImageURLPart | ImagePart) -> bytes:
    """The encoded image file a part carries; ValueError, saying why, for a URL that is not a base64
    `data:` URL (a remote URL included: workers never fetch)."""
    if isinstance(part, ImagePart):
        return part.image
    url = part.image_url.url
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https", "ftp", "file", "s3", "gs"):
        raise ValueError(f"{scheme} image URLs are not fetched; send the image inline as a data: URL "
                         "(data:image/png;base64,...) or, in msgpack, as raw bytes in an image part")
    header, sep, payload = url.partition(",")
    if scheme != "data" or not sep or not header.lower().endswith(";base64"):
        raise ValueError("an image URL must be a base64 data: URL (data:image/png;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"the data: URL is not valid base64: {exc}") from None


class Message(msgspec.Struct, frozen=True, kw_only=True):
    """One chat turn. `role` is one of ROLES; `content` is a string, or a list of parts (text and images)."""

    role: str
    content: str | list[ContentPart]

    @property
    def text(self) -> str:
        """The message's text: its text parts, one per line, for a content list."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content if isinstance(p, TextPart))

    @property
    def num_images(self) -> int:
        return 0 if isinstance(self.content, str) else sum(1 for p in self.content if not isinstance(p, TextPart))


class ChatRequest(_RequestBase, tag="chat", kw_only=True):
    """A chat completion (topic `infinilm.requests.chat`).

    Defaults follow OpenAI where it has one: temperature 1.0 and top_p 1.0 mean
    "sample from the model as is". `max_tokens` has no OpenAI default (it runs to
    the context limit); None (left out) takes the worker's chat.default_max_tokens,
    256 unless configured, so a forgotten limit cannot hold a slot for minutes.

    - `temperature`: 0 means greedy; at most 2, as in OpenAI.
    - `top_k`: -1 (or 0) disables it.
    - `min_p`: 0 disables it.
    - `seed`: any 64-bit integer; the same seed gives the same tokens.
    - `stop`: one string or a list of strings; generation stops before them.
    - `stream`: also publish token deltas to `infinilm.deltas`.
    - `deadline_ms`: absolute Unix epoch time in milliseconds (not a duration,
      not seconds); after it the request fails with `deadline_exceeded`.
    - `rules`: compliance rules checked on the output; see `Result.compliance`.
    - `deterministic`: ask for batch-invariant results; None leaves it to the
      worker's config.
    - `tenant`: who the request is billed and rate-limited as.
    - `mask_policy`: "causal" or None (the same); the engine's other policies
      serve the ASR and risk workloads, and a chat request naming one is refused.
    - `logprobs`: the result's `logprobs` lists each generated token with the
      model's log-probability for it; `top_logprobs` (0 to 20, needs `logprobs`)
      adds that many most likely tokens at each position. Such a request does
      not speculate (one token a step).
    """

    kind: ClassVar[str] = "chat"

    messages: list[Message]
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    deadline_ms: int | None = None
    rules: list[str] = msgspec.field(default_factory=list)
    deterministic: bool | None = None
    tenant: str | None = None
    mask_policy: str | None = None
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def stop_list(self) -> list[str]:
        """`stop` as a list, whichever of its three forms was sent."""
        if self.stop is None:
            return []
        if isinstance(self.stop, str):
            return [self.stop]
        return list(self.stop)


class AsrRequest(_RequestBase, tag="asr", kw_only=True):
    """One chunk of a streaming ASR transcript to post-correct (topic `infinilm.requests.asr`).

    Chunks of a stream share `stream_id` (the Kafka key, so they stay in order)
    and number themselves with `seq` from 0. `final` marks the last chunk: a
    chunk after it is refused with invalid_request (a new stream needs a new id).
    """

    kind: ClassVar[str] = "asr"

    stream_id: str
    seq: int
    text: str
    final: bool = False


class RiskItem(msgspec.Struct, frozen=True, kw_only=True):
    """One text to score; `id` is unique within its request."""

    id: str
    text: str


class RiskRequest(_RequestBase, tag="risk", kw_only=True):
    """Score each item against every label (topic `infinilm.requests.risk`).

    `instruction` replaces the default task description given to the model;
    `labels` left out (or empty) are the worker's risk.default_labels.
    """

    kind: ClassVar[str] = "risk"

    items: list[RiskItem]
    labels: list[str] = msgspec.field(default_factory=list)
    instruction: str | None = None


Request = ChatRequest | AsrRequest | RiskRequest

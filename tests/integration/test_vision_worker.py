"""An image chat through the real Kafka and Redis: a worker serving a tiny LLaVA answers image requests
sent as JSON (a base64 data: URL) and as msgpack (raw bytes), each with one committed result."""

from __future__ import annotations

import asyncio
import base64

import pytest

from schemas import ChatRequest, ImagePart, ImageURL, ImageURLPart, Message, TextPart
from tests.integration.worker_harness import chat, send_and_collect
from tests.vision_models import picture, write_tiny_llava

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory):
    return write_tiny_llava(tmp_path_factory.mktemp("tiny-llava"), seed=6)


def image_chat(rid: str, *image_parts) -> ChatRequest:
    return ChatRequest(id=rid, messages=[Message(role="user", content=[TextPart(text="what is this?"), *image_parts])],
                       max_tokens=6, temperature=0.0)


def test_image_chat_as_json_and_msgpack_gets_one_committed_result_each(worker_setup, kafka_bootstrap, tiny_llava):
    topics, start = worker_setup
    w = start(model=str(tiny_llava))
    w.wait_ready()
    png, other = picture("circle"), picture("stripes", fmt="JPEG")
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    sends = [
        (topics.chat, image_chat("img-json", ImageURLPart(image_url=ImageURL(url=url))), "json"),
        (topics.chat, image_chat("img-msgpack", ImagePart(image=png)), "msgpack"),
        (topics.chat, image_chat("img-other", ImagePart(image=other)), "msgpack"),
        (topics.chat, image_chat("img-remote", ImageURLPart(image_url=ImageURL(url="https://example.com/a.png"))),
         "json"),
        (topics.chat, chat("text-only", "no picture", max_tokens=6), "msgpack"),
    ]
    ids = ["img-json", "img-msgpack", "img-other", "img-remote", "text-only"]
    got = asyncio.run(send_and_collect(kafka_bootstrap, topics, sends, ids))
    assert sorted(got) == sorted(ids)
    assert all(len(v) == 1 for v in got.values()), {k: len(v) for k, v in got.items()}
    res = {rid: v[0] for rid, v in got.items()}
    for rid in ("img-json", "img-msgpack", "img-other", "text-only"):
        assert res[rid].status == "ok" and res[rid].usage.completion_tokens == 6, res[rid]
    # The same picture gives the same greedy answer whichever way it travelled; 16 positions per image.
    assert res["img-json"].text == res["img-msgpack"].text
    assert res["img-json"].usage.prompt_tokens == res["img-other"].usage.prompt_tokens > 16
    assert res["img-remote"].status == "error" and res["img-remote"].error.code == "invalid_request"
    assert "messages[0].content[1]" in res["img-remote"].error.message

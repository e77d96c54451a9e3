"""Image parts in chat requests: the wire forms (JSON base64, msgpack raw bytes), the chat handler's limits
and errors (each names the part), and a handler-built prompt running on a tiny LLaVA."""

from __future__ import annotations

import asyncio
import base64
import json

import msgspec
import pytest

from engine import LLM, RequestError, SamplingParams
from schemas import (
    ChatRequest,
    ImagePart,
    ImageURL,
    ImageURLPart,
    Message,
    SchemaError,
    TextPart,
    decode_request,
    encode,
)
from tests.vision_models import picture, write_tiny_llava
from worker.config import load_config
from worker.handlers import HandlerContext
from worker.handlers.chat import ChatHandler
from worker.handlers.images import ImageReader


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def chat(*parts, rid: str = "r1") -> ChatRequest:
    return ChatRequest(id=rid, messages=[Message(role="user", content=list(parts))], max_tokens=4, temperature=0)


def test_json_image_url_and_msgpack_raw_bytes_decode_to_the_same_image():
    png = picture("circle")
    as_json = json.dumps({"v": 1, "kind": "chat", "id": "a", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what?"}, {"type": "image_url", "image_url": {"url": data_url(png)}}]}]}).encode()
    req = decode_request(as_json, "application/json")
    assert isinstance(req.messages[0].content[1], ImageURLPart)
    packed = encode(chat(TextPart(text="what?"), ImagePart(image=png)), "msgpack")
    assert png in packed  # msgpack carries the file as raw bin, not base64
    req2 = decode_request(packed, "application/msgpack")
    assert req2.messages[0].content[1].image == png
    assert req.messages[0].text == req2.messages[0].text == "what?"
    # JSON carries an `image` part's bytes as base64
    again = decode_request(encode(req2, "json"), "application/json")
    assert again.messages[0].content[1].image == png


def test_bad_parts_are_schema_errors():
    with pytest.raises(SchemaError) as info:
        decode_request(b'{"v": 1, "kind": "chat", "id": "a", "messages": [{"role": "user", "content": '
                       b'[{"type": "video", "url": "x"}]}]}', "application/json")
    assert info.value.code == "bad_request" and info.value.request_id == "a"
    with pytest.raises(SchemaError) as info:
        decode_request(encode(chat(ImageURLPart(image_url=ImageURL(url=""))), "json"), "application/json")
    assert info.value.code == "invalid_request" and "messages[0].content[0].image_url.url" in info.value.message


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return LLM(model=str(write_tiny_llava(tmp_path_factory.mktemp("llava"), seed=5)), dtype="float32")


def ctx_for(llm: LLM, **chat_overrides) -> HandlerContext:
    cfg = load_config(None)
    cfg = msgspec.structs.replace(cfg, chat=msgspec.structs.replace(cfg.chat, **chat_overrides))
    return HandlerContext(tokenizer=llm.tokenizer, max_model_len=llm.engine.max_model_len,
                          max_num_batched_tokens=2048, worker_id="t", model_name="tiny-llava", config=cfg,
                          images=ImageReader.for_engine(llm.engine, cfg.chat))


def prepare_error(req: ChatRequest, ctx: HandlerContext) -> RequestError:
    with pytest.raises(RequestError) as info:
        asyncio.run(ChatHandler().prepare(req, ctx))
    assert info.value.code == "invalid_request"
    return info.value


def test_the_handler_puts_images_where_the_parts_are_and_the_engine_runs_them(llava):
    ctx = ctx_for(llava)
    png, jpeg = picture("circle"), picture("noise", fmt="JPEG")
    req = chat(TextPart(text="compare"), ImageURLPart(image_url=ImageURL(url=data_url(png))), ImagePart(image=jpeg))
    prepared = asyncio.run(ChatHandler().prepare(req, ctx))
    (work,) = prepared.work
    assert len(work.images) == 2
    assert work.image_positions == 2 * (llava.engine.model_config.vision.num_image_tokens - 1)
    text = llava.tokenizer.apply_chat_template([{"role": "user", "content": "compare\n<image>\n<image>"}])
    assert work.prompt_token_ids == llava.tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(max_tokens=4, temperature=0)
    via_handler = llava.generate([work.prompt_token_ids], params, images=[list(work.images)])[0]
    direct = llava.generate([text], params, images=[[png, jpeg]])[0]
    assert via_handler.error is None and via_handler.token_ids == direct.token_ids


def test_remote_urls_are_refused_naming_the_part(llava):
    err = prepare_error(chat(TextPart(text="hi"), ImageURLPart(image_url=ImageURL(url="https://example.com/a.png"))),
                        ctx_for(llava))
    assert "messages[0].content[1]" in err.message and "not fetched" in err.message


def test_too_many_images_is_refused_naming_the_first_one_over(llava):
    png = picture("circle")
    err = prepare_error(chat(ImagePart(image=png), TextPart(text="x"), ImagePart(image=png)),
                        ctx_for(llava, max_images=1))
    assert err.message.startswith("messages[0].content[2]: too many images; the limit is 1")


def test_corrupt_and_oversized_images_are_refused_naming_the_part(llava):
    err = prepare_error(chat(TextPart(text="x"), ImagePart(image=b"\x89PNG broken")), ctx_for(llava))
    assert err.message.startswith("messages[0].content[1] is not a readable image")
    err = prepare_error(chat(ImagePart(image=picture("noise", (64, 64)))), ctx_for(llava, max_image_bytes=200))
    assert err.message.startswith("messages[0].content[0] has") and "the limit is 200" in err.message
    err = prepare_error(chat(ImagePart(image=picture("circle", (200, 100)))), ctx_for(llava, max_image_pixels=10_000))
    assert "200x100 = 20000 pixels; the limit is 10000" in err.message
    err = prepare_error(chat(ImageURLPart(image_url=ImageURL(url="data:image/png;base64,@@@"))), ctx_for(llava))
    assert "messages[0].content[0]: the data: URL is not valid base64" in err.message


def test_an_image_to_a_text_only_model_is_refused_naming_the_part(tiny_llama):
    llm = LLM(model=str(tiny_llama), dtype="float32")
    ctx = ctx_for(llm)
    assert ctx.images is None
    err = prepare_error(chat(TextPart(text="hi"), ImagePart(image=picture("circle"))), ctx)
    assert err.message == "messages[0].content[1]: this model takes no images (it has no vision tower)"
    # text parts alone still work on a text model
    prepared = asyncio.run(ChatHandler().prepare(chat(TextPart(text="hi"), TextPart(text="there")), ctx))
    assert prepared.work[0].images == ()

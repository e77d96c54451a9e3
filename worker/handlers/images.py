"""A chat request's image parts, turned into the engine's preprocessed images within the chat limits.

Every failure is a RequestError (invalid_request) that names the part, `messages[i].content[j]`, so the
request fails alone with an answer the client can act on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine import RequestError
from engine.vision.preprocess import ImageInput, ImageLimits
from schemas import ChatRequest, TextPart, image_data


@dataclass(frozen=True)
class ImageReader:
    load: Callable[[bytes, ImageLimits, str], ImageInput]  # EngineCore.load_image
    placeholder: str  # the image token's text: where the chat template should put an image
    positions_per_image: int  # prompt positions each placeholder expands to
    limits: ImageLimits
    max_images: int

    @classmethod
    def for_engine(cls, engine: Any, chat_config: Any) -> ImageReader | None:
        """The reader for a vision model; None for a text-only one."""
        vision = engine.model_config.vision
        if vision is None or engine.tokenizer is None:
            return None
        return cls(engine.load_image, engine.tokenizer.token_text(vision.image_token_id), vision.num_image_tokens,
                   ImageLimits(chat_config.max_image_bytes, chat_config.max_image_pixels), chat_config.max_images)

    async def read(self, req: ChatRequest) -> tuple[ImageInput, ...]:
        """Decode and preprocess the request's images, in prompt order, off the event loop."""
        raw = image_parts(req, self)
        if not raw:
            return ()
        return await asyncio.to_thread(lambda: tuple(self.load(data, self.limits, name) for name, data in raw))


def image_parts(req: ChatRequest, reader: ImageReader | None) -> list[tuple[str, bytes]]:
    """(part name, encoded bytes) of each image part, checked against the model and the count limit."""
    out: list[tuple[str, bytes]] = []
    for i, message in enumerate(req.messages):
        if isinstance(message.content, str):
            continue
        for j, part in enumerate(message.content):
            if isinstance(part, TextPart):
                continue
            name = f"messages[{i}].content[{j}]"
            if reader is None:
                raise RequestError(f"{name}: this model takes no images (it has no vision tower)")
            if len(out) == reader.max_images:
                raise RequestError(f"{name}: too many images; the limit is {reader.max_images} per request")
            try:
                out.append((name, image_data(part)))
            except ValueError as exc:
                raise RequestError(f"{name}: {exc}") from None
    return out


def template_messages(req: ChatRequest, placeholder: str | None) -> list[dict[str, str]]:
    """Messages for the chat template: each content list becomes one string, its parts one per line, an
    image as the model's placeholder token (LLaVA's `<image>\\nquestion` form)."""
    messages = []
    for m in req.messages:
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
        else:
            lines = [p.text if isinstance(p, TextPart) else placeholder or "" for p in m.content]
            messages.append({"role": m.role, "content": "\n".join(lines)})
    return messages

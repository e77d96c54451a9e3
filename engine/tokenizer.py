"""Tokenizer and chat template from a model folder, without transformers.

Encoding and decoding use the `tokenizers` library on tokenizer.json; the chat
template from tokenizer_config.json is rendered with a sandboxed jinja2
environment, the way Hugging Face renders it.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from engine.errors import InvalidRequestError, ModelLoadError


class Tokenizer:
    def __init__(self, folder: Path, extra_eos_ids: tuple[int, ...] = ()) -> None:
        path = Path(folder) / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{folder} has no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(path))
        cfg_path = Path(folder) / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template: str | None = self.config.get("chat_template")
        # A chat_template.jinja in the folder wins over tokenizer_config.json's template: it is how a
        # deployment replaces a template the renderer cannot take (llava-1.5's list-content one).
        template_file = Path(folder) / "chat_template.jinja"
        if template_file.is_file():
            self.chat_template = template_file.read_text()
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.add_bos_token = bool(self.config.get("add_bos_token", False))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        eos = set(extra_eos_ids)
        if self.eos_token and self._tok.token_to_id(self.eos_token) is not None:
            eos.add(self._tok.token_to_id(self.eos_token))
        self.eos_token_ids: frozenset[int] = frozenset(eos)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def vocab(self) -> dict[str, int]:
        """Token text -> id, added tokens included."""
        return self._tok.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def decode_stream(self, skip_special_tokens: bool = True) -> DecodeStream:
        """An incremental detokenizer: feed ids one at a time, get text pieces back."""
        return DecodeStream(skip_special_tokens=skip_special_tokens)

    def step_stream(self, stream: DecodeStream, token_id: int) -> str | None:
        return stream.step(self._tok, token_id)

    @cached_property
    def _template(self) -> jinja2.Template:
        if not self.chat_template:
            raise InvalidRequestError("this model has no chat template; send a plain prompt instead")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise_template_error
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent, ensure_ascii=ensure_ascii)
        return env.from_string(self.chat_template)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise InvalidRequestError("each chat message needs 'role' and 'content'")
            # Templates concatenate them as text; anything else renders as its repr, or fails inside jinja.
            for key in ("role", "content"):
                if not isinstance(message[key], str):
                    raise InvalidRequestError(
                        f"message {i}: '{key}' must be a string, got {type(message[key]).__name__}")
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "",
            )
        except (jinja2.TemplateError, TypeError) as exc:
            raise InvalidRequestError(f"chat template failed: {exc}") from exc


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # AddedToken serialisation
        return value.get("content")
    return value


def _raise_template_error(message: str) -> None:
    raise jinja2.TemplateError(message)

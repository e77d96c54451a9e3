"""The engine's frozen configuration and the values derived from it at runtime.

`EngineConfig` is what a user sets: the settings declared in engine/settings.py,
read flat. `CacheLayout` is what the engine works out when it starts (how many
KV blocks fit); it never writes back into the config.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from types import NoneType, UnionType
from typing import Annotated, Literal, Union, get_args, get_origin, get_type_hints

import msgspec
import torch

from engine.errors import InvalidRequestError
from engine.settings import (
    EngineOptions,
    ExecutionSettings,
    MemorySettings,
    ModelSettings,
    ParallelSettings,
    QuantizationSettings,
    Settings,
    SpeculativeSettings,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MASK_POLICIES = ("causal", "chunk_bidirectional", "prefix_bidirectional", "packed_segments")


# The engine's names for the settings whose config.yaml key differs: name -> (group, key).
RENAMED = {
    "model": ("model", "name"),
    "max_model_len": ("model", "max_seq_len"),
    "kv_cache_memory_bytes": ("memory", "kv_cache_bytes"),
    "speculative_method": ("speculative", "method"),
    "num_speculative_tokens": ("speculative", "k"),
    "prompt_lookup_max": ("speculative", "n"),
    "prompt_lookup_min": ("speculative", "n_min"),
}
GROUPS: dict[str, type[Settings]] = {
    "model": ModelSettings,
    "execution": ExecutionSettings,
    "memory": MemorySettings,
    "quantization": QuantizationSettings,
    "speculative": SpeculativeSettings,
    "parallel": ParallelSettings,
    "options": EngineOptions,
}


def _engine_names() -> dict[str, tuple[str, str]]:
    """Every engine setting's name -> (group, key), in the groups' order."""
    renamed = {where: name for name, where in RENAMED.items()}
    names: dict[str, tuple[str, str]] = {}
    for group, cls in GROUPS.items():
        for key in cls.__struct_fields__:
            name = renamed.get((group, key), key)
            if name in names:
                raise TypeError(f"engine setting {name} is declared in both {names[name][0]} and {group}")
            names[name] = (group, key)
    return names


ENGINE_NAMES = _engine_names()


class EngineConfig:
    """Everything that shapes one engine instance; frozen.

    Each setting is declared once, in engine/settings.py, and read here as a
    flat attribute under its engine name: the group's key, except for RENAMED
    (`model`, `max_model_len`, `kv_cache_memory_bytes` and the speculative settings). Two ways in:

    - `EngineConfig(model=..., block_size=...)`: keyword options (the offline
      API, tests, benchmarks), validated here by the groups' own rules;
    - `EngineConfig.from_groups(model=..., execution=..., ...)`: groups a config
      file already gave and validated (the service's sections), used as they are.

    Values the engine derives when it starts (such as how many KV blocks fit)
    live in `CacheLayout`, never here.
    """

    def __init__(self, **options: object) -> None:
        unknown = sorted(set(options) - set(ENGINE_NAMES))
        if unknown:
            raise InvalidRequestError(
                f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(ENGINE_NAMES))}"
            )
        values: dict[str, dict[str, object]] = {group: {} for group in GROUPS}
        for name, value in options.items():
            group, key = ENGINE_NAMES[name]
            values[group][key] = os.fspath(value) if isinstance(value, os.PathLike) else value
        groups = {}
        for group, cls in GROUPS.items():
            try:
                groups[group] = msgspec.convert(values[group], cls)
            except msgspec.ValidationError as exc:
                raise InvalidRequestError(_option_error(str(exc), group, values[group])) from None
        self._set(groups)

    @classmethod
    def from_groups(cls, *, model: ModelSettings, execution: ExecutionSettings, memory: MemorySettings,
                    quantization: QuantizationSettings, speculative: SpeculativeSettings | None = None,
                    options: EngineOptions | None = None,
                    parallel: ParallelSettings | None = None) -> EngineConfig:
        """From groups that are already validated; a group may be a subclass with keys of its own."""
        config = cls.__new__(cls)
        config._set({"model": model, "execution": execution, "memory": memory, "quantization": quantization,
                     "speculative": speculative or SpeculativeSettings(), "options": options or EngineOptions(),
                     "parallel": parallel or ParallelSettings()})
        return config

    @classmethod
    def from_options(cls, **options: object) -> EngineConfig:
        """The same as `EngineConfig(**options)`: keyword options, with a clear error for unknown names."""
        return cls(**options)

    def _set(self, groups: dict[str, Settings]) -> None:
        for name, (group, key) in ENGINE_NAMES.items():
            object.__setattr__(self, name, getattr(groups[group], key))
        # The checks that span two groups.
        if self.deterministic_chunk % self.block_size:
            raise InvalidRequestError(
                f"deterministic_chunk ({self.deterministic_chunk}) must be a positive multiple of block_size")
        if self.speculative_method is not None and self.async_scheduling:
            raise InvalidRequestError("speculative decoding needs synchronous scheduling (a draft is built from "
                                      "the tokens of the step before): set async_scheduling to false or leave it unset")
        if self.speculative_method is not None and self.kv_fp_window:
            raise InvalidRequestError("speculative decoding does not run with kv_fp_window (rejected drafts would "
                                      "overwrite the window's rows); use kv_fp_window: 0")

        if self.tensor_parallel_size > 1:
            from engine.parallel.validation import check_engine_config

            check_engine_config(self)

    def replace(self, **changes: object) -> EngineConfig:
        return EngineConfig(**{**vars(self), **changes})

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"EngineConfig is frozen; use replace() to change {name}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("EngineConfig is frozen")

    def __eq__(self, other: object) -> bool:
        return vars(self) == vars(other) if isinstance(other, EngineConfig) else NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(vars(self).items()))

    def __repr__(self) -> str:
        return f"EngineConfig({', '.join(f'{name}={value!r}' for name, value in vars(self).items())})"


def _option_error(message: str, group: str, values: dict[str, object]) -> str:
    """Rewrite a group's validation error in terms of the engine's option names."""
    names = {key: name for name, (owner, key) in ENGINE_NAMES.items() if owner == group}
    path = re.fullmatch(r"(.*) - at `\$\.(\w+)`", message)
    if path is None:  # a group's own check: "key: message"
        key, _, rest = message.partition(": ")
        return f"{names.get(key, key)} {rest}" if rest else message
    key = path[2]
    hint = get_type_hints(GROUPS[group], include_extras=True)[key]
    return f"{names.get(key, key)} must be {_describe(hint)}, got {values.get(key)!r}"


def _describe(hint: object) -> str:
    """The values a field's type allows, in words: "true, false or 'auto'", "an integer >= 1"."""
    members = get_args(hint) if get_origin(hint) in (Union, UnionType) else (hint,)
    # Named values first, None last: "'auto' or an integer >= 1", "an integer >= 2 or None".
    order = {bool: 0, Literal: 1, NoneType: 3}
    members = sorted(members, key=lambda m: order.get(m, order.get(get_origin(m), 2)))
    words: list[str] = []
    for member in members:
        bounds = ""
        if get_origin(member) is Annotated:
            member, *metas = get_args(member)
            bounds = " and ".join(f"{op} {getattr(meta, attr)}" for meta in metas
                                  for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"),
                                                   ("multiple_of", "a multiple of"))
                                  if getattr(meta, attr, None) is not None)
            bounds = f" {bounds}" if bounds else ""
        if member is bool:
            words += ["true", "false"]
        elif get_origin(member) is Literal:
            words += [repr(arg) for arg in get_args(member)]
        elif member is NoneType:
            words.append("None")
        else:
            words.append({int: "an integer", float: "a number", str: "text"}.get(member, str(member)) + bounds)
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


@dataclass(frozen=True)
class CacheLayout:
    """The KV pool as sized at start-up."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    max_model_len: int
    device: torch.device
    dtype: torch.dtype
    cache_bits: int = 16
    # cache_bits 8 with a full-precision window: rows per sequence, sequences held, and their bytes.
    window: int = 0
    window_slots: int = 0
    window_bytes: int = 0
    cache_format: str = "int8"  # cache_bits 8: int8 or fp8, resolved for the device (kv_int8.resolve_cache_format)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

"""infinilm-stream's inference engine: pure compute, no service dependencies.

    from engine import LLM, SamplingParams
    llm = LLM(model="smollm2", dtype="float32")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))

The names below are imported on first use, so tools that only need part of the
package (model preparation, the CLI's --help) do not pay for importing torch.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

# INFINILM_CPU_ISA (engine/kernels/cpu_build.py) caps the libraries' CPU kernels too, MKL's GEMMs and oneDNN's
# matmuls, so that a capped run on an AVX-512 host does what a host without it does (oneDNN then has no bf16
# instructions either). Both read these once, at their first product, which comes after this import; a value
# the user set is kept.
_LIBRARY_CAPS = {"avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
                 "baseline": {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41"}}
for _name, _value in _LIBRARY_CAPS.get(os.environ.get("INFINILM_CPU_ISA", "").strip().lower(), {}).items():
    os.environ.setdefault(_name, _value)

_EXPORTS = {
    "LLM": "engine.llm",
    "AllBlocksCleared": "engine.kv_events",
    "BlockRemoved": "engine.kv_events",
    "BlockStored": "engine.kv_events",
    "EngineConfig": "engine.config",
    "EngineCore": "engine.engine_core",
    "EngineStats": "engine.outputs",
    "InvalidRequestError": "engine.errors",
    "MaskSpec": "engine.attention.metadata",
    "PromptTooLongError": "engine.errors",
    "RequestError": "engine.errors",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling_params",
}
__all__ = [
    "LLM",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EngineConfig",
    "EngineCore",
    "EngineStats",
    "InvalidRequestError",
    "MaskSpec",
    "PromptTooLongError",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
]

if TYPE_CHECKING:
    from engine.attention.metadata import MaskSpec
    from engine.config import EngineConfig
    from engine.engine_core import EngineCore
    from engine.errors import InvalidRequestError, PromptTooLongError, RequestError
    from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
    from engine.llm import LLM
    from engine.outputs import EngineStats, RequestOutput
    from engine.sampling_params import SamplingParams


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

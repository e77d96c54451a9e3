"""infinilm-stream's inference engine: pure compute, no service dependencies.

    from engine import LLM, SamplingParams
    llm = LLM(model="smollm2", dtype="float32")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))
"""

from engine.attention.metadata import MaskSpec
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.errors import InvalidRequestError, PromptTooLongError, RequestError
from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from engine.llm import LLM
from engine.outputs import EngineStats, RequestOutput
from engine.sampling_params import SamplingParams

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

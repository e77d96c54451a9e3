"""The offline API: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence

from engine.attention.metadata import CAUSAL, MaskSpec
from engine.config import EngineConfig
from engine.engine_core import EngineCore, token_id
from engine.errors import RequestError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.vision.preprocess import ImageInput

Prompt = str | list[int]


class LLM:
    """Batch generation with the continuous-batching engine, no service needed.

    `engine_options` are EngineConfig fields (max_num_seqs, max_num_batched_tokens,
    enable_prefix_caching, num_kv_blocks, ...).
    """

    def __init__(self, model: str = "smollm2", dtype: str = "auto", **engine_options: object) -> None:
        self.config = EngineConfig.from_options(model=model, dtype=dtype, **engine_options)
        self.engine = EngineCore(self.config)
        self._calls = itertools.count()  # each call's request ids are its own

    def close(self) -> None:
        """Stop the engine's tensor-parallel ranks (nothing to do for one process). Idempotent."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Sequence[Prompt] | Prompt, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, masks: Sequence[MaskSpec] | None = None, images: Sequence[Sequence[bytes | ImageInput]] | None = None,
                 progress: bool = False) -> list[RequestOutput]:
        """One output per prompt, in order. A bad request fails alone (its output carries `error`).

        `images[i]` are prompt i's images, encoded files (PNG, JPEG, ...) or ImageInputs from
        engine.load_image, one per image token in it."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and token_id(prompts[0]) is not None):
            prompts = [prompts]  # a single prompt: text, or token ids
        if not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a string, a list of token ids, or a list of those; "
                            f"got {type(prompts).__name__}")
        prompts = list(prompts)
        param_list = self._expand(params, len(prompts))
        mask_list = list(masks) if masks is not None else [CAUSAL] * len(prompts)
        if len(mask_list) != len(prompts):
            raise ValueError(f"got {len(mask_list)} masks for {len(prompts)} prompts")
        return self._run(prompts, param_list, mask_list, progress, images)

    def chat(self, conversations: Sequence[list[dict[str, str]]] | list[dict[str, str]],
             params: SamplingParams | Sequence[SamplingParams] | None = None, *, progress: bool = False) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        if isinstance(conversations, (str, bytes, dict)) or not isinstance(conversations, Sequence):
            raise TypeError("chat takes a conversation (a list of {'role': ..., 'content': ...} messages) or a "
                            f"list of conversations; got {type(conversations).__name__}")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # a single conversation
        prompts: list[Prompt | RequestError] = []
        for conv in conversations:
            try:
                text = self.engine.tokenizer.apply_chat_template(list(conv)) if self.engine.tokenizer else None
                if text is None:
                    raise RequestError("this model has no tokenizer")
                prompts.append(self.engine.tokenizer.encode(text, add_special_tokens=False))
            except RequestError as exc:
                prompts.append(exc)
        return self._run(prompts, self._expand(params, len(prompts)), [CAUSAL] * len(prompts), progress)

    @staticmethod
    def _expand(params, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        if not isinstance(params, (list, tuple)):
            raise TypeError(f"params must be a SamplingParams or a list of them, got {type(params).__name__}")
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
        return params

    def _run(self, prompts, params, masks, progress: bool, images=None) -> list[RequestOutput]:
        engine = self.engine
        images = list(images) if images is not None else [()] * len(prompts)
        if len(images) != len(prompts):
            raise ValueError(f"got image lists for {len(images)} of {len(prompts)} prompts")
        results: dict[str, RequestOutput] = {}
        call = next(self._calls)
        ids = [f"offline-{id(self)}-{call}-{i}" for i in range(len(prompts))]
        bar = None
        try:
            for i, (rid, prompt, p, mask) in enumerate(zip(ids, prompts, params, masks, strict=True)):
                try:
                    if isinstance(prompt, RequestError):
                        raise prompt
                    loaded = [data if isinstance(data, ImageInput) else engine.load_image(data, name=f"image {k}")
                              for k, data in enumerate(images[i])]
                    engine.add_request(rid, prompt, p, mask=mask, images=loaded)
                except RequestError as exc:
                    results[rid] = _error_output(rid, prompt, exc)
            bar = _progress(len(prompts) - len(results)) if progress else None
            mine = set(ids)  # the engine may still hand back an interrupted earlier call's aborted requests
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in mine:
                        results[out.request_id] = out
                        if bar:
                            bar[0].advance(bar[1])
        finally:
            if bar:
                bar[0].stop()
            # A call that ends early (an exception, Ctrl-C) takes its unfinished requests with it, so they
            # neither run on in the next call nor come back as its results.
            for rid in ids:
                if rid not in results:
                    with contextlib.suppress(Exception):  # never hide what ended the call
                        engine.abort_request(rid)
        return [results[rid] for rid in ids]


def _error_output(rid: str, prompt, exc: RequestError) -> RequestOutput:
    return RequestOutput(
        request_id=rid, prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=prompt if isinstance(prompt, list) else [], token_ids=[], text="",
        new_token_ids=[], new_text="", finished=True, finish_reason="error", error=exc,
    )


def _progress(total: int):
    from rich.progress import Progress

    bar = Progress(transient=True)
    task = bar.add_task("generating", total=total)
    bar.start()
    return bar, task

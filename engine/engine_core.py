"""EngineCore: one step is schedule -> execute -> update.

The core is single-threaded; a host (the offline `LLM`, or the worker's
engine thread) feeds it requests and calls step() in a loop.

With pipelined scheduling (config.async_scheduling, on for CUDA) a step() call
schedules and launches step N+1 before it collects step N: the device never
waits for the host's scheduling, input building, sampling bookkeeping or
detokenization, only for what of them takes longer than a forward pass. Each
call then returns step N's outputs, one step later than the synchronous loop.
"""

from __future__ import annotations

import itertools
import logging
import operator
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from engine.attention.kv_int8 import KVWindowSlots, resolve_cache_format
from engine.attention.metadata import CAUSAL, MaskSpec
from engine.attention.selection import select_backend, select_int8_backend
from engine.block_manager import BlockManager
from engine.config import DTYPES, CacheLayout, EngineConfig
from engine.draft_model import DraftModelProposer, draft_config
from engine.errors import InvalidRequestError, ModelLoadError, PromptTooLongError, RequestError
from engine.kv_cache import allocate_kv_caches, plan_cache_layout
from engine.kv_events import KVEvent
from engine.logits_processors import phrase_token_sequences
from engine.model_runner import ModelRunner, StepHandle
from engine.models.config import ModelConfig
from engine.models.embedding_offload import offload_embedding
from engine.models.loader import dummy_model, safetensors_files
from engine.output_processor import OutputProcessor
from engine.outputs import EngineStats, RequestOutput
from engine.platform_tuning import tune_model
from engine.quant.kv_scales import calibrate_at_start
from engine.quant.loading import load_engine_model, quantize_dummy_model
from engine.quant.modules import weight_bytes
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.speculative import Proposer, make_proposer
from engine.tokenizer import Tokenizer
from engine.vision.llava import VisionEncoder, load_vision_encoder, place_images
from engine.vision.preprocess import ImageInput, ImageLimits, ImageProcessor

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (device.index or 0) >= count:
            raise ModelLoadError(f"device {name!r}: this host has {count} CUDA device(s); use 'cpu' or 'auto'")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        from engine.model_registry import resolve_model

        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model_path: Path = resolve_model(config.model)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model_config = ModelConfig.from_folder(self.model_path)
        mc = self.model_config
        self.tokenizer = Tokenizer(self.model_path, mc.eos_token_ids) if (self.model_path / "tokenizer.json").is_file() else None
        self.eos_token_ids = self.tokenizer.eos_token_ids if self.tokenizer else frozenset(mc.eos_token_ids)

        max_positions = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        # Tensor parallelism (engine/parallel/): this process is rank 0 and holds its shard; the other ranks
        # are spawned here and run each step's forward pass with it.
        self.parallel = None
        if config.tensor_parallel_size > 1:
            from engine.parallel.launcher import TensorParallelGroup

            self.parallel = TensorParallelGroup(config, self.model_path, mc, self.device, self.dtype, max_positions)
            self.model, tuning = self.parallel.state.model, self.parallel.state.tuning
            self.layout: CacheLayout = self.parallel.state.layout
            self.kv_caches = self.parallel.state.kv_caches
        else:
            self.model, tuning = self._load_model(config, mc, max_positions)
            self.layout = plan_cache_layout(config, mc, self.device, self.dtype)
            self.kv_caches = allocate_kv_caches(self.layout, mc, huge_pages=config.huge_pages is True)
        calibrate_at_start(config, self.layout, self.model, self.kv_caches, self.tokenizer, self.parallel)
        # NOTE: a vision tower runs on rank 0 only, so tensor parallelism refuses vision models at start-up.
        self.vision, self.image_processor = load_vision(self.model_path, mc, config, self.dtype, self.device)
        self.prepacked_bytes, self.prepack_s, self.decode_split = (tuning.prepacked_bytes, tuning.prepack_s,
                                                                   tuning.decode_split)
        self.weight_bytes = weight_bytes(self.model)
        self.max_model_len = self.layout.max_model_len
        self.block_manager = BlockManager(self.layout.num_blocks, config.block_size, config.enable_prefix_caching)
        # The deterministic prefill grid must fit in one step's budget (a derived value).
        bs = config.block_size
        self.deterministic_grid = min(config.deterministic_chunk, config.max_num_batched_tokens // bs * bs)
        self.block_manager.deterministic_chunk = self.deterministic_grid
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, self.deterministic_grid, self._proposer(),
                                   config.num_speculative_tokens)
        self.runner = ModelRunner(self.model, self.kv_caches, config.block_size, self.device)
        self.runner.vision = self.vision
        if self.layout.window:
            self.runner.kv_window = KVWindowSlots(self.layout.window, self.layout.window_slots)
        # An 8-bit cache is captured when the Triton kernels read it and no full-precision window is kept (the
        # graphs' metadata carries no ring); the torch reference and a window run eagerly.
        # Captured graphs would replay without the ranks' collectives: tensor-parallel steps run eagerly.
        graphable = config.cache_bits == 16 or (
            not self.layout.window and self.model.layers[0].self_attn.backend.name == "triton_kvq")
        if self.device.type == "cuda" and config.cuda_graphs and graphable and self.parallel is None:
            from engine.cuda_graphs import DecodeGraphs

            self.runner.graphs = DecodeGraphs(
                self.model, self.kv_caches, config.block_size, scratch_block=self.layout.num_blocks,
                max_blocks=-(-self.max_model_len // config.block_size), max_batch=config.max_num_seqs,
                device=self.device)
            self._capture_graphs()
        self.output_processor = OutputProcessor(self.tokenizer)
        self._pending: list[RequestOutput] = []
        # Speculative decoding drafts from the step before's tokens, so it takes synchronous scheduling.
        self.pipelined = (config.async_scheduling if config.async_scheduling is not None
                          else self.device.type == "cuda" and config.speculative_method is None
                          and self.parallel is None)
        # The launched step whose tokens are not collected yet (pipelined scheduling).
        self._inflight: tuple[SchedulerOutput, StepHandle] | None = None
        self._last_idle_s: float | None = None  # device idle before the last collected step (CUDA)
        self._ids = itertools.count()
        self._steps = 0
        self.last_stats = EngineStats()

    def _proposer(self) -> Proposer | None:
        if self.config.speculative_method != "draft_model":
            return make_proposer(self.config)
        draft = EngineCore(draft_config(self.config, self.max_model_len))
        return DraftModelProposer(draft, self.model_config.vocab_size,
                                  self.tokenizer.vocab() if self.tokenizer is not None else None)

    def _load_model(self, config: EngineConfig, mc: ModelConfig, max_positions: int):
        """The whole model in this process (tensor_parallel_size 1), fitted to the machine."""
        if config.cache_bits == 8:
            backend = select_int8_backend(config.attention_backend, self.device, mc.num_heads, mc.num_kv_heads,
                                          mc.head_dim, resolve_cache_format(config.cache_format, self.device),
                                          config.kv_key_rotation)
        else:
            backend = select_backend(config.attention_backend, self.device, mc.num_heads, mc.num_kv_heads,
                                     mc.head_dim, config.block_size)
        if config.load_format == "dummy":
            model = dummy_model(mc, backend, max_positions, self.dtype, self.device, config.seed)
            if config.weight_bits != 16:
                model = quantize_dummy_model(model, config, self.device)
        else:
            model = load_engine_model(config, self.model_path, mc, backend, max_positions, self.dtype,
                                      self.device, self.tokenizer)
        if config.embedding_offload:
            offload_embedding(model, self.device)
        return model, tune_model(model, config, self.device, self.dtype)

    def check_health(self) -> None:
        """Raise EngineFailure if the engine can no longer step (a tensor-parallel rank died); hosts that sit
        idle between steps call this so that a failure shows while no step runs."""
        if self.parallel is not None:
            self.parallel.check()

    def close(self) -> None:
        """Stop the tensor-parallel ranks, if any. Idempotent. A tensor-parallel engine cannot step afterwards;
        a single-process one holds no ranks and keeps working."""
        if self.parallel is not None:
            self.parallel.shutdown()

    def _capture_graphs(self) -> None:
        """Capture the decode graphs; if that fails, serve with eager decode steps rather than not at all."""
        try:
            with torch.inference_mode():
                self.runner.graphs.capture()
        except Exception:
            log.warning("CUDA graph capture failed; decode steps run eagerly (slower, same results)",
                        exc_info=True)
            self.runner.graphs = None

    # ---- requests ------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None,
                    *, mask: MaskSpec = CAUSAL, arrival_time: float | None = None,
                    add_special_tokens: bool = True, images: Sequence[ImageInput] = ()) -> Request:
        """Validate and queue a request; raises RequestError (with a stable code) if it can't run.

        `images` (from load_image) go, in order, where the prompt has the model's image token."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight")
        prompt_text, token_ids = self._tokenize(prompt, add_special_tokens)
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        spans: tuple = ()
        if images or self.vision is not None:
            token_ids, spans = self._place_images(token_ids, images)
        vocab = self.model_config.vocab_size
        if any((not isinstance(t, int)) or isinstance(t, bool) or t < 0 or t >= vocab for t in token_ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len}, "
                "which leaves no room to generate"
            )
        if params.deterministic and self.deterministic_grid < 1:
            raise InvalidRequestError("deterministic requests need max_num_batched_tokens >= block_size")
        if any(pos >= len(token_ids) for pos in params.score_positions):
            raise InvalidRequestError("score_positions must point inside the prompt")
        if not mask.is_causal and len(token_ids) - mask.start > self.config.max_num_batched_tokens:
            raise PromptTooLongError(
                f"the {mask.policy} region and what follows it are prefilled in one step, so they may have at "
                f"most max_num_batched_tokens={self.config.max_num_batched_tokens} tokens; they have "
                f"{len(token_ids) - mask.start}"
            )
        req = Request(request_id, token_ids, params, self.eos_token_ids, mask, arrival_time, prompt_text, spans)
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a model with a tokenizer (stop_token_ids work without)")
        if params.banned_phrases:
            if self.tokenizer is None:
                raise InvalidRequestError("banned phrases need a model with a tokenizer")
            req.banned_sequences = phrase_token_sequences(self.tokenizer, params.banned_phrases)
        self.output_processor.add(req)
        self.scheduler.add(req)
        return req

    def load_image(self, data: bytes, limits: ImageLimits | None = None, name: str = "image") -> ImageInput:
        """Decode and preprocess an image for this model; InvalidRequestError, naming `name`, if it can't be used."""
        if self.image_processor is None:
            raise InvalidRequestError(f"{name}: this model takes no images (it has no vision tower)")
        return self.image_processor.load(data, limits or ImageLimits(), name)

    def _place_images(self, token_ids: list[int], images: Sequence[ImageInput]) -> tuple[list[int], tuple]:
        if self.vision is None:
            raise InvalidRequestError("image 0: this model takes no images (it has no vision tower)")
        return place_images(token_ids, images, self.model_config.vision)

    def _tokenize(self, prompt: str | list[int], add_special_tokens: bool) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer; send token ids")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if isinstance(prompt, (list, tuple)):
            return None, [t if (tid := token_id(t)) is None else tid for t in prompt]
        hint = " (pass .tolist())" if hasattr(prompt, "tolist") else ""
        raise InvalidRequestError(
            f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}{hint}")

    def abort_request(self, request_id: str) -> bool:
        req = self.scheduler.abort(request_id)
        if req is None:
            return False
        self._pending.append(self.output_processor.finish_without_token(req, "abort"))
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending) or self._inflight is not None

    def take_kv_events(self) -> list[KVEvent]:
        return self.block_manager.take_events()

    # ---- the step ------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.check_health()
        outputs, self._pending = self._pending, []
        t0 = time.perf_counter()
        inflight, self._inflight = self._inflight, None
        if inflight is not None and not _may_overlap(inflight[0]):
            # Its tokens shape the next step's sampling (banned phrases): collect it first.
            outputs += self._collect(*inflight)
            inflight = None
        sched = self.scheduler.schedule()
        handle = None
        if sched.is_empty:
            self.runner.release(sched)
        else:
            handle, error = self._launch(sched, inflight[1] if inflight else None)
            if error is not None:
                outputs += self._fail_step(sched, error)
        if handle is not None and self.pipelined:
            self.scheduler.advance(sched)
            self._inflight = (sched, handle)
        if inflight is not None:
            outputs += self._collect(*inflight)
        if handle is not None and not self.pipelined:
            outputs += self._collect(sched, handle, advance=True)
        if handle is not None:
            self._steps += 1
        self.last_stats = self._stats(sched, time.perf_counter() - t0, [o.request_id for o in outputs if o.finished])
        self.last_stats.device_idle_s = self._last_idle_s
        return outputs

    def _launch(self, sched: SchedulerOutput,
                previous: StepHandle | None) -> tuple[StepHandle | None, Exception | None]:
        now = time.monotonic()
        for s in sched.scheduled:
            req = self.scheduler.requests[s.request_id]
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
        # Denormal floats take a microcode slow path on x86 that can make a step many
        # times slower; flushing them changes nothing at our tolerances. It is a
        # per-thread CPU flag, so it is set only while the step runs and the caller's
        # floating-point state is left as it was.
        flush = self.device.type == "cpu" and torch.set_flush_denormal(True)
        try:
            return self.runner.launch(sched, previous), None
        except Exception as exc:
            # NOTE: with tensor parallelism a failed step leaves the ranks out of lockstep (one may wait in a
            # collective that the others never enter): the engine fails as a whole.
            if self.parallel is not None:
                raise self.parallel.fail(exc) from exc
            # A failure inside the forward pass must not take the engine down:
            # fail the requests of this step and keep serving the rest.
            return None, exc
        finally:
            if flush:
                torch.set_flush_denormal(False)

    def _collect(self, sched: SchedulerOutput, handle: StepHandle, advance: bool = False) -> list[RequestOutput]:
        """A launched step's tokens: into the requests, through detokenization and the stop rules."""
        try:
            result = self.runner.collect(handle)
        except Exception as exc:
            return self._fail_step(sched, exc)
        self._last_idle_s = result.device_idle_s
        for rid, scores in result.prompt_logprobs.items():
            self.output_processor.add_prompt_logprobs(rid, scores)
        outputs = []
        steps = (self.scheduler.update(sched, result.sampled, result.verified) if advance
                 else self.scheduler.resolve(sched, result.sampled, result.verified))
        for st in steps:
            req = st.request
            run = st.new_token_ids or [st.new_token_id]
            out, stop_hit, used = self.output_processor.process_run(
                req, run, result.logprobs.get(req.request_id), st.finished)
            if stop_hit and not (st.finished and used == len(run)):
                self.scheduler.finish(req, "stop", drop_last=len(run) - used)
            outputs.append(out)
        return outputs

    def _fail_step(self, sched, exc: Exception) -> list[RequestOutput]:
        err = RequestError(f"internal error during the forward pass: {exc!r}", code="internal")
        outs = []
        for s in sched.scheduled:
            req = self.scheduler.requests.get(s.request_id)
            if req is not None and not req.is_finished:
                self.scheduler.finish(req, "error")
                outs.append(self.output_processor.finish_without_token(req, "error", err))
        return outs

    def _stats(self, sched, step_time: float, finished_ids: list[str]) -> EngineStats:
        bm = self.block_manager
        decodes = [s for s in sched.scheduled if s.is_decode]
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_usage=bm.usage,
            prefix_cache_hit_rate=bm.hit_rate,
            prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            step_num_tokens=sched.num_scheduled_tokens,
            step_num_seqs=len(sched.scheduled),
            step_token_budget=self.config.max_num_batched_tokens,
            step_prefill_tokens=sched.num_scheduled_tokens - sum(len(s.token_ids) for s in decodes),
            step_decode_seqs=len(decodes),
            step_time_s=step_time,
            steps_total=self._steps,
            finished_ids=finished_ids,
            spec_draft_tokens=self.scheduler.num_draft_tokens,
            spec_accepted_tokens=self.scheduler.num_accepted_tokens,
        )


def load_vision(folder: Path, mc: ModelConfig, config: EngineConfig, dtype: torch.dtype,
                device: torch.device) -> tuple[VisionEncoder | None, ImageProcessor | None]:
    """A LLaVA model's vision encoder and image processor; (None, None) for a text-only model."""
    if mc.vision is None:
        return None, None
    if config.load_format == "dummy":
        raise ModelLoadError("load_format=dummy does not build vision models; load the checkpoint")
    processor = ImageProcessor.from_folder(folder)
    size = (mc.vision.image_size, mc.vision.image_size)
    if processor.output_size != size:
        raise ModelLoadError(f"{folder}: the image processor makes {processor.output_size} images, "
                             f"the vision tower takes {size}")
    return load_vision_encoder(folder, safetensors_files(folder), mc.vision, dtype, device), processor


def _may_overlap(sched: SchedulerOutput) -> bool:
    """Whether the next step may be built before this one's tokens are known: not when a request
    that samples in it bans phrases, since the ban depends on the token just sampled."""
    return not any(s.sample and s.banned for s in sched.scheduled)


def token_id(value: object) -> int | None:
    """`value` as a token id: ints, and numpy and torch integers through operator.index; None for what is
    no token id (bools, floats, float tensors, sequences), which the range check then refuses."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None

"""`infinilm eval ...`: quality measurements run through the engine (`eval ppl`: perplexity)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from cli.model import _fail


def ppl_command(
    text: Path = typer.Option(..., "--text", "-t", exists=True, dir_okay=False, readable=True,
                              help="Plain-text file to score (for example /usr/share/common-licenses/GPL-3)."),
    model: str = typer.Option("smollm2", "--model", "-m",
                              help="Model alias, Hugging Face folder, .gguf file, or a folder from `infinilm quantize`."),
    quant: int = typer.Option(16, "--quant", "-q",
                              help="Weight bits: 16 runs the checkpoint as stored; 8 or 4 quantize it while loading."),
    weight_format: str = typer.Option("auto", "--weight-format",
                                      help="With --quant 8: fp8, int8, or auto (fp8 on GPUs of compute capability "
                                           "8.9+, int8 elsewhere)."),
    fp8_activations: str = typer.Option("auto", "--fp8-activations",
                                        help="With fp8 weights: all (W8A8), none (W8A16 on the fp8 bytes), or auto "
                                             "(the layer roles chosen on the calibration data keep full-precision "
                                             "activations)."),
    cache_bits: int = typer.Option(16, "--cache-bits", help="KV cache precision: 16 (the model dtype) or 8 (int8)."),
    cache_format: str = typer.Option("auto", "--cache-format",
                                     help="With --cache-bits 8: int8, fp8, or auto (int8)."),
    kv_scales: str = typer.Option("absmax", "--kv-scales",
                                  help="With --cache-format fp8: the per-head scales, calibrated at start-up: absmax "
                                       "(absmax / 448), mse (least round-trip error), or unit (1.0)."),
    kv_key_rotation: str = typer.Option("auto", "--kv-key-rotation",
                                        help="With --cache-bits 8: hadamard (q and k rotated after RoPE, so the cache "
                                             "stores rotated keys), none, or auto (hadamard for fp8)."),
    kv_fp_window: int = typer.Option(0, "--kv-fp-window",
                                     help="With --cache-bits 8: recent rows per sequence kept at full precision."),
    calib: Path | None = typer.Option(None, "--calib", exists=True, dir_okay=False, readable=True,
                                      help="Calibration file for --quant 8/4 (default: the bundled text)."),
    context: int = typer.Option(1024, "--context", help="Tokens per window."),
    stride: int = typer.Option(512, "--stride", help="Tokens between window starts (<= --context)."),
    max_tokens: int | None = typer.Option(None, "--max-tokens", help="Score only the first N tokens of the text."),
    dtype: str = typer.Option("auto", "--dtype", help="float32, bfloat16, float16 or auto (fp32 on CPU)."),
    cpu_prefill_dtype: str = typer.Option("float32", "--cpu-prefill-dtype",
                                          help="CPU, fp32 models: bfloat16 runs the prompt steps' linears in bf16 "
                                               "(hosts with AVX512-BF16 or AMX), float32 keeps them exact."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Perplexity of a text under the engine, over a sliding window.

    Every token after the first is scored once, with up to CONTEXT - STRIDE tokens of context before it."""
    if quant not in (16, 8, 4):
        raise _fail(f"--quant must be 16, 8 or 4, got {quant}")
    if context < 2 or not 1 <= stride <= context:
        raise _fail(f"need --context >= 2 and 1 <= --stride <= --context; got {context} and {stride}")

    try:
        content = text.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:  # a score of replacement characters would measure nothing
        raise _fail(f"{text} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})") from None

    from rich.console import Console
    from rich.progress import Progress

    from engine import LLM
    from engine.errors import ModelLoadError, RequestError
    from engine.model_registry import ModelNotFoundError
    from engine.perplexity import perplexity
    from engine.quant.fp8_activations import w8a8_share

    try:
        llm = LLM(model, dtype=dtype, weight_bits=quant, weight_format=weight_format,
                  fp8_activations=fp8_activations, cache_bits=cache_bits,
                  cache_format=cache_format, kv_scales=kv_scales, kv_key_rotation=kv_key_rotation,
                  kv_fp_window=kv_fp_window, cpu_prefill_dtype=cpu_prefill_dtype,
                  calibration_file=str(calib) if calib else None,
                  max_model_len=context + 1, max_num_batched_tokens=max(2048, context + 1))
    except (ModelNotFoundError, ModelLoadError, RequestError, ValueError) as exc:
        raise _fail(str(exc)) from None
    ids = llm.tokenizer.encode(content)[:max_tokens]
    if len(ids) < 2:
        raise _fail(f"{text} holds {len(ids)} token(s); perplexity needs at least 2")
    start = time.perf_counter()
    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("scoring windows", total=None)
        result = perplexity(llm, ids, context, stride,
                            progress=lambda done, total: bar.update(task, completed=done, total=total))
    seconds = time.perf_counter() - start
    if as_json:
        typer.echo(json.dumps({"model": model, "weight_bits": quant, "weight_format": weight_format,
                               "fp8_activations": fp8_activations, "w8a8_share": w8a8_share(llm.engine.model),
                               "cache_bits": cache_bits,
                               "cache_format": llm.engine.layout.cache_format if cache_bits == 8 else None,
                               "kv_scales": kv_scales if llm.engine.layout.cache_format == "fp8" else None,
                               "kv_key_rotation": _key_rotation(llm) if cache_bits == 8 else None,
                               "kv_fp_window": kv_fp_window, "cpu_prefill_dtype": cpu_prefill_dtype,
                               "perplexity": result.perplexity,
                               "mean_nll": result.mean_nll, "tokens_scored": result.num_scored,
                               "windows": result.num_windows, "context": context, "stride": stride,
                               "seconds": round(seconds, 2)}))
    else:
        typer.echo(f"perplexity {result.perplexity:.4f} over {result.num_scored} tokens "
                   f"({result.num_windows} windows of {context}, stride {stride}) in {seconds:.1f}s")


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="Measure model quality through the engine.", no_args_is_help=True)
    group.command("ppl")(ppl_command)
    app.add_typer(group, name="eval")


def _key_rotation(llm) -> str:
    """What the engine's 8-bit cache stores: hadamard-rotated keys or plain ones."""
    return "none" if llm.engine.model.layers[0].self_attn.backend.key_rotation is None else "hadamard"

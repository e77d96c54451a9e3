"""`infinilm quantize`: write a quantized checkpoint (int8 or fp8 per channel, or int4 per group,
calibrated per layer) that the engine, the worker and `infinilm eval ppl` load like any model folder.
fp8 is written in the compressed-tensors layout, which other engines (vLLM) load too."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer

from cli.model import _fail


@contextmanager
def stage_progress() -> Iterator:
    """A rich progress bar per stage on stderr, as the (done, total, stage) callback quantization takes."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description:<12}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True)) as bar:
        tasks: dict[str, int] = {}

        def update(done: int, total: int, stage: str) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done, total=total)

        yield update


def quantize_command(
    model: str = typer.Option(..., "--model", "-m", help="Model alias (smollm2), Hugging Face folder or .gguf file."),
    bits: int | None = typer.Option(None, "--bits", "-b",
                                    help="8: int8 per output channel (W8A16); 4: int4 in groups (W4A16). "
                                         "Needed with --format int; fp8 is 8 bits."),
    weight_format: str = typer.Option("int", "--format",
                                      help="int: our layout (int8 or int4); fp8: E4M3 per output channel in the "
                                           "compressed-tensors layout other engines load too."),
    fp8_activations: str = typer.Option("auto", "--fp8-activations",
                                        help="--format fp8: which linears round their activations to fp8 at run "
                                             "time: all, none, or auto (chosen on the calibration data). Saved "
                                             "per layer in the compressed-tensors config."),
    out: Path = typer.Option(..., "--out", "-o", file_okay=False,
                             help="Folder to write; it must not exist or be empty unless --force."),
    calib: Path | None = typer.Option(
        None, "--calib", exists=True, dir_okay=False, readable=True,
        help="Calibration text (.txt) or JSONL (text, prompt+completion or chat messages per line). "
             "Default: the bundled English licence texts. Use text that looks like your traffic."),
    group_size: int = typer.Option(128, "--group-size", help="int4: inputs per group (a multiple of 32)."),
    calibrate: bool = typer.Option(True, "--calibrate/--no-calibrate",
                                   help="--no-calibrate: plain round-to-nearest, no calibration data (a baseline)."),
    force: bool = typer.Option(False, "--force", help="Replace OUT if it already holds files."),
) -> None:
    """Quantize a model's weights with per-layer calibration into a safetensors checkpoint.

    The folder also gets its quant config (config.json `quantization_config`).

    Serve it by passing the folder as the model."""
    if weight_format not in ("int", "fp8"):
        raise _fail(f"--format must be int or fp8, got {weight_format!r}")
    fp8 = weight_format == "fp8"
    if fp8 and bits not in (None, 8):
        raise _fail(f"--format fp8 is 8 bits; --bits {bits} does not go with it")
    if fp8_activations not in ("auto", "all", "none"):
        raise _fail(f"--fp8-activations must be auto, all or none, got {fp8_activations!r}")
    if fp8_activations != "auto" and not fp8:
        raise _fail(f"--fp8-activations {fp8_activations} goes with --format fp8")
    bits = 8 if fp8 else bits
    if bits is None:
        raise _fail("--bits is needed with --format int: 8 or 4")
    if bits not in (8, 4):
        raise _fail(f"--bits must be 8 or 4, got {bits}")
    if bits == 4 and (group_size < 32 or group_size % 32):
        raise _fail(f"--group-size must be a positive multiple of 32, got {group_size}")
    if out.exists() and any(out.iterdir()) and not force:
        raise _fail(f"{out} is not empty; pass --force to replace it")

    from engine.errors import ModelLoadError
    from engine.model_registry import ModelNotFoundError, resolve_model
    from engine.models.config import ModelConfig
    from engine.quant.checkpoint import save_quantized
    from engine.quant.convert import QuantSpec
    from engine.quant.hf_fp8 import checkpoint_dtype, to_compressed_tensors
    from engine.quant.loading import quantize_pretrained
    from engine.tokenizer import Tokenizer

    start = time.perf_counter()
    try:
        folder = resolve_model(model)
        mc = ModelConfig.from_folder(folder)
        tokenizer = Tokenizer(folder, mc.eos_token_ids) if (folder / "tokenizer.json").is_file() else None
        with stage_progress() as progress:
            state, qconfig = quantize_pretrained(folder, mc, QuantSpec(bits, group_size, calibrate, fp8=fp8,
                                                                   fp8_activations=fp8_activations),
                                                 tokenizer, calib, progress=progress)
        if fp8:
            record = {k: qconfig.get(k) for k in ("calibrated", "calibration", "fp8_activations")}
            state, ct_config = to_compressed_tensors(state, qconfig, mc, checkpoint_dtype(folder))
            written = save_quantized(folder, out, state, ct_config, overwrite=force, record=record)
        else:
            written = save_quantized(folder, out, state, qconfig, overwrite=force)
    except (ModelNotFoundError, ModelLoadError, ValueError, FileExistsError) as exc:
        raise _fail(str(exc)) from None
    size = (written / "model.safetensors").stat().st_size
    typer.echo(f"wrote {written} ({size / 2**20:.1f} MiB, {'fp8' if fp8 else f'{bits}-bit'}, "
               f"{'calibrated' if qconfig['calibrated'] else 'round-to-nearest'}) "
               f"in {time.perf_counter() - start:.1f}s", err=True)
    typer.echo(str(written))


def register(app: typer.Typer) -> None:
    app.command("quantize")(quantize_command)

"""`infinilm quantize`: write a quantized checkpoint (int8 per channel or int4 per group, calibrated
per layer) that the engine, the worker and `infinilm eval ppl` load like any model folder."""

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
    bits: int = typer.Option(..., "--bits", "-b", help="8: int8 per output channel (W8A16); 4: int4 in groups (W4A16)."),
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
    """Quantize a model's weights with per-layer calibration and write a safetensors checkpoint plus
    its quant config (config.json `quantization_config`). Serve it by passing the folder as the model."""
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
    from engine.quant.loading import quantize_pretrained
    from engine.tokenizer import Tokenizer

    start = time.perf_counter()
    try:
        folder = resolve_model(model)
        mc = ModelConfig.from_folder(folder)
        tokenizer = Tokenizer(folder, mc.eos_token_ids) if (folder / "tokenizer.json").is_file() else None
        with stage_progress() as progress:
            state, qconfig = quantize_pretrained(folder, mc, QuantSpec(bits, group_size, calibrate), tokenizer,
                                                 calib, progress=progress)
        written = save_quantized(folder, out, state, qconfig, overwrite=force)
    except (ModelNotFoundError, ModelLoadError, ValueError, FileExistsError) as exc:
        raise _fail(str(exc)) from None
    size = (written / "model.safetensors").stat().st_size
    typer.echo(f"wrote {written} ({size / 2**20:.1f} MiB, {bits}-bit, "
               f"{'calibrated' if qconfig['calibrated'] else 'round-to-nearest'}) "
               f"in {time.perf_counter() - start:.1f}s", err=True)
    typer.echo(str(written))


def register(app: typer.Typer) -> None:
    app.command("quantize")(quantize_command)

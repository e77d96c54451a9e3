"""`infinilm model ...`: import GGUF files and locate prepared model folders."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

import typer

from engine.model_registry import ALIASES, ModelNotFoundError, cache_dir, prepare_model, resolve_model


class WeightDType(StrEnum):
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"


_ALIAS_LIST = ", ".join(sorted(ALIASES))


def _fail(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    return typer.Exit(code=1)


def import_gguf_command(
    file: Path = typer.Argument(
        ..., exists=True, dir_okay=False, readable=True, help="The .gguf file to import."
    ),
    out_dir: Path = typer.Argument(
        ..., file_okay=False, help="Folder to write; it must not exist or be empty unless --force."
    ),
    dtype: WeightDType = typer.Option(
        WeightDType.float32, "--dtype", help="Float type the weights are dequantized to."
    ),
    force: bool = typer.Option(False, "--force", help="Replace OUT_DIR if it already holds files."),
) -> None:
    """Convert a GGUF file (llama, qwen2, qwen3) into a Hugging Face folder: config, safetensors, tokenizer."""
    from engine.gguf_import.importer import console_progress, import_gguf
    from engine.gguf_import.metadata import GGUFImportError

    try:
        with console_progress(f"importing {file.name}") as progress:
            folder = import_gguf(file, out_dir, dtype=dtype.value, progress=progress, overwrite=force)
    except (GGUFImportError, FileExistsError) as exc:
        raise _fail(str(exc)) from None
    typer.echo(str(folder))


def prepare_command(
    alias: str = typer.Argument(..., help=f"Model alias: {_ALIAS_LIST}."),
    force: bool = typer.Option(
        False, "--force", help="Import again even if the cache already holds the model."
    ),
) -> None:
    """Import an aliased model into the cache (INFINILM_CACHE_DIR, default ~/.cache/infinilm) and print its folder."""
    try:
        folder = prepare_model(alias, force=force)
    except (ModelNotFoundError, ValueError) as exc:  # GGUFImportError is a ValueError
        raise _fail(str(exc)) from None
    typer.echo(str(folder))


def path_command(
    name: str = typer.Argument(..., help=f"Alias ({_ALIAS_LIST}), Hugging Face folder, or .gguf file."),
) -> None:
    """Print the model folder for NAME, importing it on first use (progress goes to stderr)."""
    try:
        folder = resolve_model(name)
    except (ModelNotFoundError, ValueError) as exc:  # GGUFImportError is a ValueError
        raise _fail(str(exc)) from None
    typer.echo(str(folder))


def register(app: typer.Typer) -> None:
    """Add the `model` command group to the top-level app."""
    group = typer.Typer(
        help=f"Prepare and locate model folders. Aliases: {_ALIAS_LIST}. Cache: {cache_dir()} (INFINILM_CACHE_DIR).",
        no_args_is_help=True,
    )
    group.command("import-gguf")(import_gguf_command)
    group.command("prepare")(prepare_command)
    group.command("path")(path_command)
    app.add_typer(group, name="model")

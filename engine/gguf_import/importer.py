"""import_gguf: a GGUF file to an HF-format folder, written aside and renamed into place."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import gguf
import torch
from gguf import GGMLQuantizationType as QType

from engine.gguf_import.metadata import (
    SUPPORTED_ARCHS,
    GGUFImportError,
    GGUFMetadata,
    build_config,
    build_generation_config,
)
from engine.gguf_import.tokenizer import build_tokenizer
from engine.gguf_import.weights import ProgressCallback, plan_tensors, write_safetensors

# Bump when the folder written for the same GGUF changes, so cached imports are redone.
IMPORTER_VERSION = 1
IMPORT_INFO_FILE = "gguf_import.json"
_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def import_gguf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    dtype: str = "float32",
    progress: ProgressCallback | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the GGUF model at `gguf_path` as an HF-format folder at `out_dir` and return its path.

    The folder holds config.json, model.safetensors (weights dequantized to `dtype`: float32,
    float16 or bfloat16), tokenizer.json, tokenizer_config.json, generation_config.json and
    gguf_import.json (provenance). It is built in a temporary sibling folder and renamed into place,
    so an interrupted import never leaves a partial `out_dir`. An existing non-empty `out_dir` is
    replaced only with `overwrite=True`. Raises GGUFImportError for unsupported architectures,
    tensor types or tokenizers.
    """
    src = Path(gguf_path)
    out = Path(out_dir).expanduser().absolute()
    if dtype not in _TORCH_DTYPES:
        raise GGUFImportError(f"dtype must be one of {sorted(_TORCH_DTYPES)}, not {dtype!r}")
    if _is_nonempty_dir(out) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; pass overwrite=True to replace it")

    reader = gguf.GGUFReader(src)
    meta = GGUFMetadata(reader)
    arch = meta.require("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise GGUFImportError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(SUPPORTED_ARCHS)}")
    tensors = {t.name: t for t in reader.tensors}
    config = build_config(meta, arch, tensors, dtype)
    plan = plan_tensors(arch, config, tensors)
    tokenizer, tokenizer_config = build_tokenizer(meta)
    generation_config = build_generation_config(meta)
    import_info = {
        "importer_version": IMPORTER_VERSION,
        "source": src.name,
        "source_size": src.stat().st_size,
        "dtype": dtype,
        "tensor_types": sorted({QType(t.tensor_type).name for t in reader.tensors}),
    }

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.importing-", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the model folder should not be
        write_safetensors(tmp / "model.safetensors", plan, _TORCH_DTYPES[dtype], progress)
        tokenizer.save(str(tmp / "tokenizer.json"))
        for name, payload in (
            ("config.json", config),
            ("tokenizer_config.json", tokenizer_config),
            ("generation_config.json", generation_config),
            (IMPORT_INFO_FILE, import_info),
        ):
            (tmp / name).write_text(
                json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
            )
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


@contextlib.contextmanager
def console_progress(description: str) -> Iterator[ProgressCallback]:
    """A rich progress bar on stderr, as a ProgressCallback for `import_gguf`."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int, name: str) -> None:
            bar.update(task, completed=done, total=total)

        yield update


def _is_nonempty_dir(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())


def _move_into_place(tmp: Path, out: Path) -> None:
    if not _is_nonempty_dir(out):
        os.replace(tmp, out)  # also replaces an empty directory
        return
    # A directory cannot be renamed over a non-empty one: move the old one aside first, so `out`
    # is missing only between two renames and never half written.
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.replace(out, old / "model")
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


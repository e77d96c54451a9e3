"""Build a C++ kernel source as it was at an earlier git revision, for A/B benchmarks in one process.

`build_at_revision("71f4fbc", ["engine/attention/csrc/paged_attention_cpu.cpp"], ["paged_decode_attention"])`
returns an extension module compiled from those files at that commit, with the engine's own compiler
flags (engine.kernels.cpu_build), under a name of its own so that it loads beside the current
kernels. Needs a git checkout that has the revision.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent
# What the engine's translation unit has included before a file that is not the first one.
PRELUDE = "#include <torch/extension.h>\n#include <ATen/Parallel.h>\n#include <algorithm>\n#include <vector>\n"


SHARED = "engine/kernels/csrc/vec_loads.cpp"


def has_file(rev: str, path: str) -> bool:
    return subprocess.run(["git", "cat-file", "-e", f"{rev}:{path}"], cwd=REPO, capture_output=True).returncode == 0


def source_at(rev: str, path: str) -> str:
    try:
        return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=REPO, check=True, capture_output=True,
                              text=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = (getattr(exc, "stderr", "") or str(exc)).strip()
        raise SystemExit(f"cannot read {path} at {rev!r} (needs a git checkout with that commit): {detail}") from None


def build_at_revision(rev: str, paths: list[str], functions: list[str]) -> ModuleType:
    from torch.utils.cpp_extension import load_inline

    from engine.kernels.cpu_build import build_flags

    # From the at::vec rewrite on, every kernel file builds on the shared loads compiled first in the engine's unit.
    shared = [SHARED] if SHARED not in paths and has_file(rev, SHARED) else []
    source = PRELUDE + "\n".join(source_at(rev, p) for p in shared + paths)
    flags = build_flags()
    digest = hashlib.sha1((source + " ".join(flags)).encode()).hexdigest()[:12]
    return load_inline(name=f"infinilm_bench_base_{digest}", cpp_sources=[source], functions=functions,
                       extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)

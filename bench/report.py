"""What every benchmark shares: tables, the docs section it owns, the command that reproduces it."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
# Generated sections live in per-topic files here; docs/BENCHMARKS.md holds only the headline numbers.
PERF = REPO / "docs" / "perf"
console = Console()

_DOCS_INTRO = ("Generated sections: each sits between its own markers and is rewritten by its script; edit the scripts, "
               "not these sections. Raw numbers are in `bench/results/`.\n")


# Environment variables that change what a benchmark runs; a run's command line names those it had.
RUN_ENV = ("INFINILM_CPU_ISA", "LLAMACPP_VENV")


def invocation(module: str) -> str:
    """The command line that reproduces this run, relative to the repository root."""
    python = os.path.relpath(sys.executable, REPO) if sys.executable.startswith(str(REPO)) else sys.executable
    env = [f"{name}={shlex.quote(os.environ[name])}" for name in RUN_ENV if os.environ.get(name)]
    return " ".join([*env, shlex.join([python, "-m", module, *sys.argv[1:]])])


def run_info(module: str, threads: int) -> dict:
    """What publish_table reports about a run: its command, date, load average, threads and CPU kernel path."""
    return {"command": invocation(module), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load": os.getloadavg()[0], "threads": threads, "isa": isa_path()}


def isa_path() -> str:
    """Which instruction-set path the CPU kernels run ("avx512", "avx2", "baseline"); printed by the CPU
    benchmarks, since the same host gives other figures under INFINILM_CPU_ISA."""
    from engine.kernels.cpu_build import host_isa, target_isa

    isa = target_isa()
    console.print(f"CPU kernels: the {isa} path (this host's best: {host_isa()}; INFINILM_CPU_ISA caps it)")
    return isa


def print_table(title: str, headers: list[str], rows: list[tuple]) -> None:
    table = Table(title=title, title_justify="left")
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*map(str, row))
    console.print(table)


def markdown_table(title: str, headers: list[str], rows: list[tuple]) -> str:
    lines = [f"**{title}**", "", "| " + " | ".join(headers) + " |",
             "|" + "|".join(["---"] + ["---:"] * (len(headers) - 1)) + "|"]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)


def write_json(name: str, data: dict) -> Path:
    """Write `data` to bench/results/`name`; `name` may hold a subfolder ("kernels/panel_gemm.json")."""
    path = RESULTS / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path


def update_docs_section(key: str, body: str, docs: Path) -> None:
    """Replace (or append) the section between `<!-- key:start -->` and `<!-- key:end -->` of `docs`."""
    start, end = f"<!-- {key}:start -->", f"<!-- {key}:end -->"
    block = f"{start}\n{body.strip()}\n{end}"
    text = docs.read_text() if docs.exists() else _DOCS_INTRO
    if start in text and end in text:
        text = text[:text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    docs.parent.mkdir(parents=True, exist_ok=True)
    docs.write_text(text)


def publish_table(key: str, heading: str, data: dict, how: str, title: str, headers: list[str],
                  rows: list[tuple], extra: str = "", *, docs: Path) -> None:
    """Print a one-table result and write it as the `key` section of `docs` (a file under docs/perf/).

    `data` holds the run's "date", "load", "threads" and "command"; `how` says what was measured;
    `extra`, already printed by the caller, is markdown appended to the section.
    """
    print_table(title, headers, rows)
    update_docs_section(key, "\n\n".join([
        f"### {heading}",
        f"Measured {data['date']} (load average {data['load']:.1f}, {data['threads']} threads) with "
        f"`{data['command']}`: {how}",
        markdown_table(title, headers, rows),
        *([extra] if extra else []),
    ]), docs)

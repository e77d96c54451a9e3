"""`infinilm kernels build`: compile the CPU kernels ahead of the first request.

A first build takes about a minute per instruction set on a small host; the engine otherwise pays it at its
first load. `--all` builds every instruction set this CPU runs (the test suite loads them all), one process
each, side by side: each build is one compiler process.
"""

from __future__ import annotations

import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context

import typer


def _build(isa: str) -> tuple[float, str]:
    from engine.kernels import cpu_build

    cpu_build.SHOW_BUILD_STATUS = False  # the parent shows one line an instruction set
    start = time.perf_counter()
    module = cpu_build.load_kernels(isa)
    return time.perf_counter() - start, str(module.__file__)


def build_command(
    isa: str | None = typer.Option(None, help="avx512, avx2 or baseline; default: the one the engine loads here "
                                              "(the host's best, or INFINILM_CPU_ISA)."),
    every: bool = typer.Option(False, "--all", help="Every instruction set this CPU runs, built side by side."),
) -> None:
    """Build (or find in the cache) the CPU kernel module, and print where it is."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from engine.kernels import cpu_build

    if isa is not None and every:
        typer.echo("error: give --isa or --all, not both", err=True)
        raise typer.Exit(2)
    try:
        isas = cpu_build.runnable_isas() if every else (cpu_build.checked_isa(isa, source=f"--isa {isa}"),)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    ready, failed = {}, []
    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=Console(stderr=True),
                   transient=True)
    # spawn: each build starts clean, not from a fork of this process's torch threads.
    with bar, ProcessPoolExecutor(max_workers=len(isas), mp_context=get_context("spawn")) as pool:
        jobs = {pool.submit(_build, name): (name, bar.add_task(f"{name}: building (or loading from the cache)", total=1))
                for name in isas}
        for job in as_completed(jobs):
            name, task = jobs[job]
            bar.update(task, completed=1, visible=False)
            try:
                seconds, path = job.result()
            except Exception as exc:  # a missing compiler or headers: the engine then runs torch's ops
                failed.append(f"{name}: {exc}")
                continue
            ready[name] = f"{name}: ready in {seconds:.1f} s: {path}"
    for name in isas:
        if name in ready:
            typer.echo(ready[name])
    for line in failed:
        typer.echo(f"error: the CPU kernels could not be built ({line}); the engine falls back to torch's ops",
                   err=True)
    if failed:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add the `kernels` command group to the top-level app."""
    group = typer.Typer(help="The CPU kernels: one C++ module per instruction set, built once and cached.",
                        no_args_is_help=True)
    group.command("build")(build_command)
    app.add_typer(group, name="kernels")

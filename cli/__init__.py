"""The `infinilm` command line.

Each command group lives in its own module and registers itself on `app`
through `register(app)`; this file only assembles them.
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="infinilm",
    help="infinilm-stream: a Kafka-native LLM inference service.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)

# Modules of this package that define `register(app: typer.Typer) -> None`.
_COMMAND_MODULES = ("model", "generate", "stack", "worker", "client", "demo", "quantize", "evaluate", "config",
                    "kernels")


def _register_all() -> None:
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(f"cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"cli.{name}":
                continue  # command group not built yet
            raise
        module.register(app)


_register_all()


def main() -> None:
    app()

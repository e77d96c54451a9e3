"""`infinilm config ...`: validate a config file and show the effective configuration."""

from __future__ import annotations

from pathlib import Path

import typer
import yaml

from worker.config import ServiceConfig, load_config
from worker.config_types import ConfigError

_PATH_HELP = "The config.yaml to read; without it, the defaults. INFINILM__SECTION__KEY variables apply either way."


def _load_or_exit(path: Path | None) -> ServiceConfig:
    try:
        return load_config(path)
    except ConfigError as exc:
        typer.secho(f"error: {exc}", err=True, fg=typer.colors.RED)
        raise typer.Exit(code=1) from None


def check_command(path: Path | None = typer.Argument(None, help=_PATH_HELP)) -> None:
    """Validate the configuration as a worker would at start-up: every key, secret file and engine setting."""
    config = _load_or_exit(path)
    try:
        for secret in config.secrets().values():
            secret.get()
        config.engine_config()
    except ConfigError as exc:
        typer.secho(f"error: {exc}", err=True, fg=typer.colors.RED)
        raise typer.Exit(code=1) from None
    typer.echo(f"OK: {path if path is not None else 'defaults'}")


def show_command(path: Path | None = typer.Argument(None, help=_PATH_HELP)) -> None:
    """Print the effective configuration as YAML, after env overrides, with secrets masked."""
    config = _load_or_exit(path)
    typer.echo(yaml.safe_dump(config.redacted_dict(), sort_keys=False, allow_unicode=True), nl=False)


def register(app: typer.Typer) -> None:
    """Add the `config` command group to the top-level app."""
    group = typer.Typer(help="Validate and show the worker configuration.", no_args_is_help=True)
    group.command("check")(check_command)
    group.command("show")(show_command)
    app.add_typer(group, name="config")

"""`infinilm worker`: run one worker (one consumer-group member) until SIGTERM."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command(help="Run a worker: consume requests, run the engine, publish results exactly once.")
    def worker(
        config: Path | None = typer.Option(None, "--config", "-c", help="config.yaml (env INFINILM__* overrides it)."),
        worker_id: str | None = typer.Option(None, "--worker-id", help="Stable id (default: hostname-pid)."),
        metrics_port: int | None = typer.Option(None, "--metrics-port", help="Override metrics.port (0: any free)."),
    ) -> None:
        from worker.config import ConfigError, load_config

        try:
            cfg = load_config(config)
        except ConfigError as exc:
            typer.echo(f"config error: {exc}", err=True)
            raise typer.Exit(2) from exc
        asyncio.run(_run(cfg, worker_id, metrics_port))


async def _run(cfg, worker_id: str | None, metrics_port: int | None) -> None:
    import msgspec

    from worker.service import Worker, default_worker_id
    from worker.structured_logging import configure_logging

    if metrics_port is not None:
        cfg = msgspec.structs.replace(cfg, metrics=msgspec.structs.replace(cfg.metrics, port=metrics_port))
    wid = worker_id or cfg.worker.id or default_worker_id()
    configure_logging(cfg.logging.level, cfg.logging.format, wid)
    w = Worker(cfg, wid)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, w.stop)
    await w.run()

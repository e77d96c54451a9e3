"""`infinilm worker`: run one worker (one consumer-group member) until SIGTERM.

Exit codes: 0 after a clean shutdown, 2 for an invalid configuration (a model that cannot
be found or loaded included), 3 when Kafka or
Redis refused the worker at start-up (wrong credentials, untrusted certificate,
unreadable secret file, no broker answering); the log line says which.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import typer

EXIT_CONFIG = 2
EXIT_NO_ACCESS = 3
EXIT_ENGINE_FAILED = 4  # the engine died under a running worker (a tensor-parallel rank was lost)


def register(app: typer.Typer) -> None:
    @app.command(help="Run a worker: consume requests, run the engine, publish results exactly once.")
    def worker(
        config: Path | None = typer.Option(None, "--config", "-c", help="config.yaml (env INFINILM__* overrides it)."),
        worker_id: str | None = typer.Option(None, "--worker-id", help="Stable id (default: hostname-pid)."),
        metrics_port: int | None = typer.Option(None, "--metrics-port", help="Override metrics.port (0: any free)."),
    ) -> None:
        # No option takes a secret: command lines are visible to every user through `ps`.
        # Passwords come from the config's {file: ...} / {env: ...} or INFINILM__* variables.
        from worker.config import load_config
        from worker.config_types import ConfigError

        try:
            cfg = load_config(config)
        except ConfigError as exc:
            typer.echo(f"config error: {exc}", err=True)
            raise typer.Exit(EXIT_CONFIG) from exc
        code = asyncio.run(_run(cfg, worker_id, metrics_port))
        if code:
            raise typer.Exit(code)


async def _run(cfg, worker_id: str | None, metrics_port: int | None) -> int:
    import msgspec
    import structlog

    from worker.preflight import ACCESS_ERRORS, check_access
    from worker.structured_logging import configure_logging

    if metrics_port is not None:
        cfg = msgspec.structs.replace(cfg, metrics=msgspec.structs.replace(cfg.metrics, port=metrics_port))
    wid = worker_id or cfg.worker.resolved_id()
    configure_logging(cfg.logging.level, cfg.logging.format, wid)
    log = structlog.get_logger("infinilm.worker")
    try:
        await check_access(cfg, wid)
    except ACCESS_ERRORS as exc:
        log.error("cannot start", reason=str(exc))
        return EXIT_NO_ACCESS

    from engine import RequestError
    from engine.errors import ModelLoadError
    from engine.model_registry import ModelNotFoundError
    from worker.service import Worker  # loads torch: only once the checks passed

    try:
        w = Worker(cfg, wid)  # builds the engine: loads the model, sizes the KV cache
    except (ModelNotFoundError, ModelLoadError, RequestError, ValueError) as exc:  # GGUFImportError: a ValueError
        log.error("cannot start", reason=f"model {cfg.model.name!r}: {exc}")
        return EXIT_CONFIG
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, w.stop)
    try:
        await w.run()
    except ACCESS_ERRORS as exc:  # the credentials changed between the check and the start
        log.error("cannot start", reason=str(exc))
        return EXIT_NO_ACCESS
    code = EXIT_ENGINE_FAILED if w.engine_failure is not None else 0
    if w.stuck_tasks:
        # Results and offsets are committed or aborted by now; asyncio.run would cancel the
        # stuck tasks once more and wait for them for ever, so leave without it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code

"""structlog set-up: JSON lines (or console) with the worker id on every event.

Prompt and output text are never logged unless `logging.log_prompts` is on.
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(level: str = "info", fmt: str = "json", worker_id: str | None = None) -> None:
    renderer = structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    # Route the stdlib loggers (aiokafka, the engine) through the same renderer.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(processors=[
        structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer], foreign_pre_chain=shared))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level.upper())
    logging.getLogger("aiokafka").setLevel(max(logging.WARNING, root.level))
    if worker_id:
        structlog.contextvars.bind_contextvars(worker_id=worker_id)

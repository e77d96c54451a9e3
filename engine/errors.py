"""Errors the engine raises for a single request.

Each carries a stable `code` that the worker copies into error results, so the
codes here must match the wire codes in `schemas/`.
"""

from __future__ import annotations


class RequestError(ValueError):
    """A request the engine refuses; it fails alone and never affects others."""

    code = "invalid_request"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self)


class InvalidRequestError(RequestError):
    code = "invalid_request"


class PromptTooLongError(RequestError):
    code = "prompt_too_long"


class ModelLoadError(RuntimeError):
    """The model folder is missing, incomplete or of an unsupported architecture."""


class EngineFailure(RuntimeError):
    """The engine cannot go on (a tensor-parallel rank died or hung): its host must stop, not retry."""

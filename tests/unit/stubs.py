"""Stand-ins shared by unit tests."""

from __future__ import annotations


class AsyncStub:
    """A stand-in for a Kafka client class: takes any constructor arguments, and `async with` gives itself."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        pass

"""A private redis-server for tests that stop, pause or lock down Redis.

Runs in the foreground as our child on a free port in a temp folder, with
persistence off, so a test can kill and restart it (or SIGSTOP it) without
touching the shared server of the local stack on 6379.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

START_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrivateRedis:
    """One redis-server process on 127.0.0.1:`port`; `start()` again after `stop()` reuses the port."""

    def __init__(self, workdir: Path, password: str | None = None) -> None:
        server = shutil.which("redis-server")
        if server is None:
            raise RuntimeError("redis-server is not installed")
        self.server = server
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.password = password
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [
            self.server,
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dir",
            str(self.workdir),
            "--save",
            "",
            "--appendonly",
            "no",
            "--logfile",
            str(self.workdir / "redis.log"),
        ]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(
            port=self.port, password=self.password, socket_timeout=1, socket_connect_timeout=1
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while True:
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                    time.sleep(0.05)
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is None:
            return
        self.resume()  # a stopped process cannot act on SIGTERM
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the port still accepts connections, but nothing answers."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

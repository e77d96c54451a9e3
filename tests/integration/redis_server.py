"""A private redis-server for tests that stop, pause or lock down Redis.

Runs in the foreground as our child on a free port in a temp folder, with
persistence off, so a test can kill and restart it (or SIGSTOP it) without
touching the shared server of the local stack on 6379.
"""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

START_TIMEOUT_S = 10.0


_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port on 127.0.0.1 that binds now and that this process has not handed out before.

    Chosen below the kernel's ephemeral range: a port the kernel picks (bind to 0) is one it also gives to
    outgoing connections, and one of the suite's many Kafka clients can take it between this call and the
    server's bind, or while a private server is down for a restart on the same port."""
    low = _ephemeral_low()
    for _ in range(500):
        port = random.randrange(max(1024, low - 12000), low)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port on 127.0.0.1 below {low}")


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

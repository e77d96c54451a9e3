"""Processes of the local stack (devstack/stack.py): detached starts, pid files, stopping,
waiting for a service to answer, and the state folder's lock."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

Progress = Callable[[str], None]


class StackError(RuntimeError):
    """The local stack could not be fetched, started or stopped; the message names the log to read."""


def spawn_detached(argv: list[str], log_path: Path) -> int:
    # sh puts the command in the background and exits at once, so the service is re-parented to
    # init: it outlives the caller, leaves no zombie and no live Popen object behind, and
    # start_new_session keeps the terminal's Ctrl+C away from it.
    script = 'log="$1"; shift; "$@" >>"$log" 2>&1 </dev/null & echo $!'
    done = subprocess.run(
        ["/bin/sh", "-c", script, "sh", str(log_path), *argv],
        capture_output=True, text=True, timeout=30, start_new_session=True, check=True,
    )  # fmt: skip
    return int(done.stdout.strip())


def read_pid(pid_file: Path, marker: str | None = None) -> int | None:
    """The live pid in pid_file, or None. A marker guards against a pid recycled by another program."""
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    if not pid_alive(pid):
        return None
    cmdline = Path(f"/proc/{pid}/cmdline")
    if marker and cmdline.exists():
        with contextlib.suppress(OSError):
            if marker.encode() not in cmdline.read_bytes():
                return None
    return pid


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still accepts signal 0; it only waits to be reaped, so count it as gone.
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    return True


def stop_process(pid_file: Path, name: str, marker: str, timeout_s: float, say: Progress) -> None:
    """SIGTERM the live process in pid_file, then SIGKILL after timeout_s; remove the pid file."""
    pid = read_pid(pid_file, marker)
    if pid is None:
        pid_file.unlink(missing_ok=True)
        say(f"{name}: no process of ours is running")
        return
    say(f"Stopping {name} (pid {pid})")
    os.kill(pid, signal.SIGTERM)
    if not wait_gone(pid, timeout_s):
        say(f"{name} ignored SIGTERM for {timeout_s:.0f}s; sending SIGKILL")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        if not wait_gone(pid, 10.0):
            raise StackError(f"{name} (pid {pid}) survived SIGKILL")
    pid_file.unlink(missing_ok=True)
    say(f"{name} stopped")


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def wait_for(
    ready: Callable[[], bool], name: str, logs: Sequence[Path], timeout_s: float, pid: int | None
) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if pid is not None and not pid_alive(pid):
            raise StackError(
                f"{name} exited during startup; see {' and '.join(map(str, logs))}\n"
                f"--- last lines of {logs[0]}:\n{tail_file(logs[0])}"
            )
        if time.monotonic() > deadline:
            raise StackError(
                f"{name} did not answer within {timeout_s:.0f}s; see {' and '.join(map(str, logs))}"
            )
        time.sleep(0.5)


def port_open(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1.0):
        return True
    return False


@contextlib.contextmanager
def state_lock(state_dir: Path, timeout_s: float) -> Iterator[None]:
    # Two `up`s at once (CLI and a test session, or parallel test workers) must not both
    # start a broker on the same data folder; the lock waits for the other one to finish.
    state_dir.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    with open(state_dir / ".lock", "w") as handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise StackError(
                        f"another stack command held {handle.name} for {timeout_s:.0f}s"
                    ) from None
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def tail(text: str, lines: int = 20) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def tail_file(path: Path, lines: int = 20) -> str:
    try:
        return tail(path.read_text(errors="replace"), lines)
    except OSError:
        return ""

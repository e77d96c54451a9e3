"""Run real worker processes (`infinilm worker`) against per-test topics.

Each test gets its own request/result topics and consumer group, a config file
written for it, and workers started as subprocesses through the CLI, so the
tests exercise exactly what a user runs, including SIGKILL and SIGTERM.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from schemas import ChatRequest, Message
from tests.integration.redis_server import free_port
from worker.client import RequestProducer, TopicReader, collect_results

REPO = Path(__file__).resolve().parents[2]
# `infinilm` from this checkout, whatever console script the environment has installed.
INFINILM = [sys.executable, "-m", "cli"]


@dataclass
class Topics:
    chat: str
    asr: str
    risk: str
    results: str
    deltas: str
    dlq: str

    def as_dict(self) -> dict[str, str]:
        return dict(self.__dict__)


def make_topics(make_topic, partitions: int = 3) -> Topics:
    return Topics(
        chat=make_topic("chat", partitions), asr=make_topic("asr", partitions), risk=make_topic("risk", partitions),
        results=make_topic("results", partitions), deltas=make_topic("deltas", 1), dlq=make_topic("dlq", 1),
    )


def write_config(path: Path, *, model: str, topics: Topics, group: str, bootstrap: str, redis_url: str,
                 **sections) -> Path:
    cfg = {
        "model": {"name": model, "dtype": "float32"},
        "execution": {"batch_timeout": "20ms", "max_batch_size": 8},
        "memory": {"kv_cache_bytes": "256MiB"},
        "kafka": {"bootstrap_servers": bootstrap, "group_id": group, "transactional_id_prefix": group,
                  "session_timeout_ms": 6000, "heartbeat_interval_ms": 1000, "flush_interval_ms": 50},
        "topics": topics.as_dict(),
        "redis": {"url": redis_url, "key_prefix": group},
        "logging": {"level": "info", "format": "json"},
        "worker": {"shutdown_timeout_s": 20},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(cfg))
    return path


@dataclass
class WorkerProcess:
    config: Path
    worker_id: str
    log_path: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)  # added to this process's environment

    def start(self) -> WorkerProcess:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - kept open for the process's life
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.proc = subprocess.Popen(
            [*INFINILM, "worker", "--config", str(self.config), "--worker-id", self.worker_id,
             "--metrics-port", str(self.port)],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
        )
        return self

    def ready(self) -> dict | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=2) as resp:
                return json.loads(resp.read())
        except Exception:
            return None

    def wait_ready(self, timeout: float = 120, assigned: bool = True) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.worker_id} exited with {self.proc.returncode}:\n{self.logs()[-4000:]}")
            state = self.ready()
            if state and state.get("ok") and (not assigned or state.get("assigned_partitions", 0) > 0):
                return state
            time.sleep(0.3)
        raise TimeoutError(f"worker {self.worker_id} not ready in {timeout}s:\n{self.logs()[-4000:]}")

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as resp:
            return resp.read().decode()

    def signal(self, sig: int) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float = 60) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if hasattr(self, "_log"):
            self._log.close()

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_events(self) -> list[dict]:
        events = []
        for line in self.logs().splitlines():
            if line.startswith("{"):
                with contextlib.suppress(json.JSONDecodeError):
                    events.append(json.loads(line))
        return events


def chat(rid: str, text: str = "hello there", max_tokens: int = 8, **kw) -> ChatRequest:
    return ChatRequest(id=rid, messages=[Message(role="user", content=text)], max_tokens=max_tokens,
                       temperature=0.0, **kw)


async def send_and_collect(bootstrap, topics, sends, expect_ids, timeout=120.0, linger=3.0, topic_role="results"):
    """Send (topic, payload, fmt[, key]) tuples; return {id: [results]} read until all arrive plus `linger` s."""
    async with TopicReader(bootstrap, getattr(topics, topic_role)) as reader:
        async with RequestProducer(bootstrap) as producer:
            for send in sends:
                await producer.send(*send)
        got = await collect_results(reader, expect_ids, timeout)
        # Keep reading a little to catch duplicates that arrive after the last first copy.
        extra = await collect_results(reader, expect_ids, linger)
    for rid, results in extra.items():
        got.setdefault(rid, []).extend(results)
    return got


async def send_and_watch(bootstrap: str, topics: Topics, requests: list, on_result, fmt: str = "msgpack",
                         timeout: float = 180.0, linger: float = 4.0) -> dict:
    """Send requests, read every committed result until all ids arrived plus `linger` s (to catch
    duplicates); `on_result(result)` sees each one as it comes (to inject a fault mid-run)."""
    from schemas import decode_result

    seen: dict = {}
    wanted = {r.id for r in requests}
    async with TopicReader(bootstrap, topics.results) as reader:
        async with RequestProducer(bootstrap) as producer:
            for r in requests:
                await producer.send(topics.chat, r, fmt)
        done_at = None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for rec in await reader.poll():
                result = decode_result(rec.value)
                seen.setdefault(result.id, []).append(result)
                on_result(result)
            if done_at is None and wanted <= set(seen):
                done_at = time.monotonic()
            if done_at is not None and time.monotonic() - done_at > linger:
                break
    return seen


def lost_and_duplicated(requests: list, seen: dict) -> tuple[list[str], dict[str, int]]:
    missing = sorted(r.id for r in requests if r.id not in seen)
    return missing, {rid: len(v) for rid, v in seen.items() if len(v) > 1}

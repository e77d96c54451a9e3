"""The local redis-server: probe, start (daemonized, no persistence), and install it when missing."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from devstack.config import StackConfig
from devstack.processes import Progress, StackError, tail
from devstack.security import write_private


def redis_ping(cfg: StackConfig) -> bool:
    # No client-side retries: a probe answers now, and redis-py counts a refused login as a
    # connection error that it would retry with backoff, for seconds.
    client = redis.Redis(
        host=cfg.redis_host,
        port=cfg.redis_port,
        password=cfg.redis_password,
        socket_timeout=2,
        socket_connect_timeout=2,
        retry=Retry(NoBackoff(), 0),
    )
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def start_redis(cfg: StackConfig, say: Progress) -> None:
    server = shutil.which("redis-server") or _install_redis(say)
    cfg.redis_dir.mkdir(parents=True, exist_ok=True)
    cfg.logs_dir.mkdir(parents=True, exist_ok=True)
    say(f"Starting redis-server on {cfg.redis_host}:{cfg.redis_port} (log {cfg.redis_log})")
    # Daemonized redis writes its own pid file; persistence is off because the stack holds
    # only caches and state that workers rebuild.
    conf = []
    if cfg.redis_password is not None:
        # From a file, not argv, where `ps` would show it.
        conf_path = cfg.redis_dir / "auth.conf"
        write_private(conf_path, f'requirepass "{cfg.redis_password}"\n')
        conf = [str(conf_path)]
    argv = [
        server, *conf, "--bind", cfg.redis_host, "--port", str(cfg.redis_port), "--daemonize", "yes",
        "--dir", str(cfg.redis_dir), "--logfile", str(cfg.redis_log), "--pidfile", str(cfg.redis_pid_file),
        "--save", "", "--appendonly", "no",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise StackError(
            f"redis-server failed to start; see {cfg.redis_log}:\n{tail(done.stdout + done.stderr)}"
        )


def _install_redis(say: Progress) -> str:
    if shutil.which("apt-get") is None:
        raise StackError(
            "redis-server is not installed and apt-get is unavailable: install Redis 6+ yourself"
        )
    # sudo -n never prompts, so an unattended run fails fast instead of hanging on a password.
    prefix = [] if os.geteuid() == 0 else ["sudo", "-n"]
    say(f"redis-server not found: installing it with `{' '.join([*prefix, 'apt-get install redis-server'])}`")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for step in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "redis-server"],
    ):
        done = subprocess.run([*prefix, *step], capture_output=True, text=True, timeout=600, env=env)
        if done.returncode != 0:
            raise StackError(
                f"`{' '.join(step)}` failed; install redis-server yourself:\n{tail(done.stdout + done.stderr)}"
            )
    server = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not Path(server).exists():
        raise StackError("apt-get installed redis-server but it is not on PATH")
    return server

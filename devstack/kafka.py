"""The local Kafka broker's process: its jars (fetched once with Maven), server.properties,
storage format (with SCRAM users when secured), and the detached JVM."""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import secrets
import shutil
import subprocess
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from pathlib import Path

from devstack.config import StackConfig
from devstack.processes import Progress, StackError, spawn_detached, tail
from devstack.security import (
    ensure_tls_material,
    server_security_properties,
    storage_format_argfile,
    users_fingerprint,
    write_private,
)

log = logging.getLogger(__name__)

KAFKA_OPS_DIR = Path(__file__).resolve().parents[1] / "ops" / "local" / "kafka"


def kafka_version(pom: Path = KAFKA_OPS_DIR / "pom.xml") -> str:
    """The broker version pinned in ops/local/kafka/pom.xml."""
    root = ET.parse(pom).getroot()
    element = root.find("m:properties/m:kafka.version", {"m": "http://maven.apache.org/POM/4.0.0"})
    if element is None or not (element.text or "").strip():
        raise StackError(f"{pom} has no <kafka.version> property")
    return element.text.strip()


def ensure_kafka_libs(cfg: StackConfig | None = None, *, progress: Progress | None = None) -> Path:
    """The folder of Kafka jars for kafka_version(), fetched with Maven on first use."""
    cfg = cfg or StackConfig()
    say = progress or log.info
    version = kafka_version()
    libs = cfg.cache_dir / "kafka" / version / "libs"
    # The marker names the pom it was fetched for: a jar added to the pom fetches the set again.
    marker = f"{version} {hashlib.sha1((KAFKA_OPS_DIR / 'pom.xml').read_bytes()).hexdigest()}\n"
    if _fetched(libs, marker):
        return libs
    mvn = shutil.which("mvn")
    if mvn is None:
        raise StackError("Maven (mvn) is needed once to fetch the Kafka jars: apt-get install maven")
    # Fetch into a private folder and rename it into place, so an interrupted or concurrent
    # fetch never leaves a half-filled libs/ that later runs would trust.
    partial = libs.with_name(f"libs.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    say(f"Fetching Kafka {version} jars with Maven into {libs} (first run only, a minute or two)")
    argv = [
        mvn, "-q", "-B", "-Dstyle.color=never", "-f", str(KAFKA_OPS_DIR / "pom.xml"),
        "dependency:copy-dependencies", "-DincludeScope=runtime", f"-DoutputDirectory={partial}",
    ]  # fmt: skip
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=cfg.fetch_timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise StackError(
            f"Maven did not finish fetching Kafka {version} in {cfg.fetch_timeout_s:.0f}s"
        ) from exc
    if done.returncode != 0 or not any(partial.glob("kafka_2.13-*.jar")):
        shutil.rmtree(partial, ignore_errors=True)
        raise StackError(f"Maven failed to fetch Kafka {version}:\n{tail(done.stdout + done.stderr)}")
    (partial / ".complete").write_text(marker)
    if _fetched(libs, marker):  # someone else finished first; theirs may be in use
        shutil.rmtree(partial, ignore_errors=True)
        return libs
    shutil.rmtree(libs, ignore_errors=True)  # a leftover without the marker is never trusted
    try:
        partial.rename(libs)
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)
        if not _fetched(libs, marker):
            raise
    return libs


def _fetched(libs: Path, marker: str) -> bool:
    try:
        return (libs / ".complete").read_text() == marker
    except OSError:
        return False


def server_properties(cfg: StackConfig, security: Mapping[str, str] | None = None) -> str:
    props = {
        "process.roles": "broker,controller",
        "node.id": "1",
        # A static quorum: one voter, known up front, so formatting needs no --standalone dance.
        "controller.quorum.voters": f"1@{cfg.kafka_host}:{cfg.controller_port}",
        "listeners": f"PLAINTEXT://{cfg.kafka_host}:{cfg.kafka_port},CONTROLLER://{cfg.kafka_host}:{cfg.controller_port}",
        "advertised.listeners": f"PLAINTEXT://{cfg.kafka_host}:{cfg.kafka_port}",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "inter.broker.listener.name": "PLAINTEXT",
        "controller.listener.names": "CONTROLLER",
        "log.dirs": str(cfg.kafka_data_dir),
        "num.partitions": str(cfg.partitions),
        # One broker, so every replication factor and min ISR must be 1 or writes are refused.
        "default.replication.factor": "1",
        "min.insync.replicas": "1",
        "offsets.topic.replication.factor": "1",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        # The default 50 partitions per internal topic make the first group or transaction
        # slow to start on a small CI machine; a dev broker needs far fewer.
        "offsets.topic.num.partitions": "8",
        "transaction.state.log.num.partitions": "8",
        "group.initial.rebalance.delay.ms": "0",
        "message.max.bytes": str(cfg.message_max_bytes),
        "replica.fetch.max.bytes": str(cfg.message_max_bytes),
        # Topics are created deliberately (ensure_topics), so a misspelt name fails loudly
        # instead of silently creating a new topic.
        "auto.create.topics.enable": "false",
        "log.retention.hours": "24",
        "log.segment.bytes": str(64 * 1024 * 1024),
        **(security or {}),
    }
    return "".join(f"{key}={value}\n" for key, value in props.items())


def _security_properties(cfg: StackConfig, say: Progress) -> dict[str, str]:
    keystore = None
    if cfg.kafka_tls_port is not None:
        say(f"Using the TLS CA in {cfg.tls_dir} (clients trust {cfg.tls_cafile})")
        _, keystore = ensure_tls_material(cfg.tls_dir, [cfg.kafka_host])
    return server_security_properties(
        cfg.kafka_host,
        cfg.kafka_port,
        cfg.controller_port,
        cfg.kafka_tls_port,
        cfg.sasl_users[0],
        # Checked only between this process's broker and controller halves: a new one each start.
        controller_password=secrets.token_urlsafe(24),
        tls_keystore=keystore,
    )


def _check_formatted_users(cfg: StackConfig) -> None:
    try:
        salt, fingerprint = cfg.kafka_users_marker.read_text().split()
    except (OSError, ValueError):
        salt, fingerprint = "", None
    if fingerprint != users_fingerprint(cfg.sasl_users, salt):
        raise StackError(
            f"the Kafka storage in {cfg.kafka_data_dir} was formatted with other SASL users (or none). "
            f"Users are fixed when the storage is formatted: use another state folder, or delete "
            f"{cfg.state_dir / 'kafka'} to start over"
        )


def _format_storage(cfg: StackConfig, java: list[str], say: Progress) -> None:
    say(f"Formatting Kafka storage in {cfg.kafka_data_dir}")
    # Kafka's cluster id is 16 random bytes in unpadded url-safe base64. One in 64 starts with
    # "-", which the tool's parser takes for an option; Kafka's own Uuid.randomUuid skips those too.
    cluster_id = "-"
    while cluster_id.startswith("-"):
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
    args = ["kafka.tools.StorageTool", "format", "--config", str(cfg.kafka_properties),
            "--cluster-id", cluster_id, "--ignore-formatted"]  # fmt: skip
    argfile = cfg.state_dir / "kafka" / "format.args"
    if cfg.sasl_users:
        args = [f"@{storage_format_argfile(argfile, args, cfg.sasl_users)}"]
    try:
        done = subprocess.run([*java, *args], capture_output=True, text=True, timeout=cfg.start_timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise StackError(f"Formatting Kafka storage timed out; see {cfg.kafka_log}") from exc
    finally:
        argfile.unlink(missing_ok=True)
    if done.returncode != 0:
        raise StackError(f"Formatting Kafka storage failed:\n{tail(done.stdout + done.stderr)}")
    if cfg.sasl_users:
        salt = secrets.token_hex(16)
        write_private(cfg.kafka_users_marker, f"{salt} {users_fingerprint(cfg.sasl_users, salt)}\n")


def _java_argv(cfg: StackConfig, libs: Path) -> list[str]:
    java_home = os.environ.get("JAVA_HOME")
    java = str(Path(java_home) / "bin" / "java") if java_home else shutil.which("java")
    if not java or not Path(java).exists():
        raise StackError("Java 17+ is needed to run Kafka: apt-get install openjdk-17-jre-headless")
    return [
        java,
        f"-Xms{cfg.kafka_heap}",
        f"-Xmx{cfg.kafka_heap}",
        "-XX:+UseG1GC",
        "-XX:MaxGCPauseMillis=20",
        "-XX:+ExitOnOutOfMemoryError",
        "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={KAFKA_OPS_DIR / 'log4j2.properties'}",
        f"-Dkafka.logs.dir={cfg.logs_dir}",
        "-cp",
        str(libs / "*"),  # java expands the wildcard itself
    ]


def start_kafka(cfg: StackConfig, say: Progress) -> int:
    libs = ensure_kafka_libs(cfg, progress=say)
    java = _java_argv(cfg, libs)
    cfg.kafka_data_dir.mkdir(parents=True, exist_ok=True)
    cfg.logs_dir.mkdir(parents=True, exist_ok=True)
    formatted = (cfg.kafka_data_dir / "meta.properties").exists()
    if formatted and cfg.sasl_users:
        _check_formatted_users(cfg)
    if cfg.sasl_users:
        # It holds the stack user's password (the broker's own login).
        write_private(cfg.kafka_properties, server_properties(cfg, _security_properties(cfg, say)))
    else:
        cfg.kafka_properties.write_text(server_properties(cfg))
    if not formatted:
        _format_storage(cfg, java, say)
    say(f"Starting Kafka {kafka_version()} on {cfg.bootstrap_servers} (logs in {cfg.logs_dir})")
    pid = spawn_detached([*java, "kafka.Kafka", str(cfg.kafka_properties)], cfg.kafka_console_log)
    cfg.kafka_pid_file.write_text(f"{pid}\n")
    return pid

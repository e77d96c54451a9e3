"""A client that nobody here wrote: Kafka's own console producer and consumer, talking to a real worker.

Requests go in as a shell user would send them (JSON lines, `key<TAB>value`, `parse.key=true`); results
come back through `ConsoleConsumer` with `isolation.level=read_committed` and are read with plain
`json.loads`, never with our decoders. The key sets are those pinned in tests/unit/schemas/test_wire_contract.py.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

from devstack.kafka import ensure_kafka_libs
from tests.unit.schemas.test_wire_contract import ASR_ERROR_KEYS, ERROR_KEYS, result_keys_ok

pytestmark = pytest.mark.integration

CONSOLE_LINE = re.compile(r"^Partition:(\d+)\tOffset:(\d+)\t([^\t]*)\t(.*)$")


def kafka_tool(libs: Path, main_class: str, args: list[str], stdin: str = "", timeout: float = 120) -> str:
    """Run one of Kafka's console tools from the jars the local stack fetched; its stdout."""
    done = subprocess.run(["java", "-cp", f"{libs}/*", main_class, *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def console_produce(libs: Path, bootstrap: str, topic: str, keyed: list[tuple[str, dict]]) -> None:
    lines = "".join(f"{key}\t{json.dumps(value)}\n" for key, value in keyed)
    kafka_tool(libs, "org.apache.kafka.tools.ConsoleProducer",
               ["--bootstrap-server", bootstrap, "--topic", topic, "--reader-property", "parse.key=true"], lines)


def console_consume(libs: Path, bootstrap: str, topic: str, count: int, timeout_s: float) -> list[tuple]:
    """(partition, offset, key, value dict) of the first `count` committed records, from the beginning."""
    out = kafka_tool(libs, "org.apache.kafka.tools.consumer.ConsoleConsumer", [
        "--bootstrap-server", bootstrap, "--topic", topic, "--from-beginning", "--max-messages", str(count),
        "--timeout-ms", str(int(timeout_s * 1000)), "--command-property", "isolation.level=read_committed",
        "--formatter-property", "print.key=true", "--formatter-property", "print.partition=true",
        "--formatter-property", "print.offset=true"], timeout=timeout_s + 60)
    records = []
    for line in out.splitlines():
        if m := CONSOLE_LINE.match(line):
            records.append((int(m[1]), int(m[2]), m[3], json.loads(m[4])))
    return records


def chat(rid: str, text: str, **extra) -> dict:
    return {"id": rid, "kind": "chat", "messages": [{"role": "user", "content": text}], "max_tokens": 12,
            "temperature": 0} | extra


def asr(stream: str, seq: int, text: str) -> dict:
    return {"id": f"{stream}-{seq}", "kind": "asr", "stream_id": stream, "seq": seq, "text": text}


def test_console_clients_get_every_answer_once_with_status_and_one_streams_results_in_seq_order(
        worker_setup, kafka_bootstrap, stack_config):
    libs = ensure_kafka_libs(stack_config)
    topics, start = worker_setup
    w = start(model="smollm2", asr={"gap_timeout_s": 60})
    w.wait_ready(timeout=300)
    chats = [chat("c1", "What is the capital of France?"), chat("c2", "Name a prime number."),
             chat("c3", "Quote me a price for order 1204.", rules=["forbid: guaranteed"])]
    bad = chat("c4", "Hello", max_tokens=0)  # invalid_request
    console_produce(libs, kafka_bootstrap, topics.chat, [(c["id"], c) for c in [*chats, bad]])
    # Chunk 1 first: it waits for chunk 0 (a later offset of the same partition), then both succeed.
    stream = [asr("call-7", 1, "on tuesday in the main conference room"),
              asr("call-7", 0, "so the meeting is at ten thirty"),
              asr("call-7", 2, "please bring the budget report")]
    console_produce(libs, kafka_bootstrap, topics.asr, [("call-7", c) for c in stream])
    risk = {"id": "r1", "kind": "risk", "labels": ["low", "high"],
            "items": [{"id": "tx1", "text": "Wire of $9,900 to a new overseas account"}]}
    console_produce(libs, kafka_bootstrap, topics.risk, [("r1", risk)])

    expected = len(chats) + 1 + len(stream) + 1
    records = console_consume(libs, kafka_bootstrap, topics.results, expected, timeout_s=300)
    by_id = defaultdict(list)
    for *_, value in records:
        by_id[value["id"]].append(value)
    assert sorted(by_id) == sorted([*(c["id"] for c in chats), "c4", *(c["id"] for c in stream), "r1"])
    assert all(len(v) == 1 for v in by_id.values()), {k: len(v) for k, v in by_id.items()}
    # Nothing more arrives: every id was answered once.
    assert len(console_consume(libs, kafka_bootstrap, topics.results, expected + 1, timeout_s=5)) == expected

    for c in chats:
        (result,) = by_id[c["id"]]
        result_keys_ok(result, "chat+rules" if "rules" in c else "chat")
        assert result["text"].strip()
    (error,) = by_id["c4"]
    assert set(error) == ERROR_KEYS and error["status"] == "error"
    assert error["error"]["code"] == "invalid_request"
    (scored,) = by_id["r1"]
    result_keys_ok(scored, "risk")
    assert set(scored["items"][0]["scores"]) == {"low", "high"}

    # The stream's results: keyed by its id, on one partition, in seq order on that partition.
    mine = sorted((p, o, k, v) for p, o, k, v in records if v["kind"] == "asr")
    assert {k for _, _, k, _ in mine} == {"call-7"}
    assert len({p for p, *_ in mine}) == 1
    assert [v["seq"] for *_, v in mine] == [0, 1, 2]
    for *_, v in mine:
        result_keys_ok(v, "asr")
    assert not set(mine[0][3]) >= ASR_ERROR_KEYS  # ok results carry no error

"""`infinilm produce` and `infinilm consume` without a broker: what a bad request or an unreachable broker
looks like (one line, an exit code, nothing sent), and the client pieces under them. With a real broker and
worker: tests/integration/test_client.py."""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import warnings
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from cli import app
from tests.unit.stubs import AsyncStub
from worker import client as client_module
from worker.client import RequestProducer, TopicReader

runner = CliRunner()


def reader_of(values: list[bytes], consumed: list[bytes] | None = None):
    """A TopicReader stand-in that yields `values` as records, noting each in `consumed`."""

    class Reader(AsyncStub):
        async def records(self, timeout_s: float):
            for offset, value in enumerate(values):
                if consumed is not None:
                    consumed.append(value)
                yield SimpleNamespace(value=value, offset=offset)

    return Reader


def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(("args", "says"), [
    (["--max-tokens", "0"], "`$.max_tokens`"),
    (["--temperature", "3"], "`$.temperature`"),
    (["--kind", "asr", "--seq", "-1"], "`$.seq`"),
    (["--kind", "risk", "--label", "yes", "--label", "yes"], "duplicate value 'yes'"),
])
def test_a_request_a_worker_would_refuse_is_not_sent(args, says):
    # The broker address answers nothing: had the command tried to send, it would say so instead.
    result = runner.invoke(app, ["produce", "--text", "hi", "--bootstrap", f"127.0.0.1:{closed_port()}", *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("not sent: invalid_request: ") and says in result.stderr, result.stderr
    assert "Traceback" not in result.output and result.stdout == ""


@pytest.mark.parametrize(("body", "says"), [
    (b'{"kind": "chat", "max_token": 5, "messages": [{"role": "user", "content": "hi"}]}',
     "not sent: the worker would not read `max_token` (did you mean `max_tokens`?); fix them, or send anyway "
     "with --allow-unknown"),
    (b'{"kind": "chat", "max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}',
     "not sent: invalid_request: "),
    (b'{"kind": "chat", "messages": [', "is not JSON"),
    (b'[{"kind": "chat"}]', "must hold one JSON object (a request), not a list"),
])
def test_a_request_file_a_worker_would_refuse_or_misread_is_not_sent(tmp_path, body, says):
    request = tmp_path / "request.json"
    request.write_bytes(body)
    result = runner.invoke(app, ["produce", "--file", str(request), "--bootstrap", f"127.0.0.1:{closed_port()}"])
    assert result.exit_code == 2, result.output
    assert says in result.stderr and "Traceback" not in result.output and result.stdout == "", result.stderr


@pytest.mark.parametrize("args", [[], ["--text", "hi", "--file", "request.json"]])
def test_produce_takes_the_request_as_text_or_as_a_file(args):
    result = runner.invoke(app, ["produce", *args])
    assert result.exit_code == 2 and "as --text" in result.stderr and "or as --file" in result.stderr, result.output


def test_a_request_file_that_cannot_be_read_is_one_line(tmp_path):
    result = runner.invoke(app, ["produce", "--file", str(tmp_path / "nowhere.json")])
    assert result.exit_code == 2 and result.stderr.startswith("cannot read "), result.output


def test_an_unknown_wire_format_is_one_line_and_exit_code_2():
    result = runner.invoke(app, ["produce", "--text", "hi", "--format", "xml"])
    assert result.exit_code == 2
    assert result.stderr.strip() == "--format must be json or msgpack, got 'xml'"


@pytest.mark.parametrize("command", [["produce", "--text", "hi"], ["consume", "--max", "1", "--timeout", "1"]])
def test_an_unreachable_broker_is_one_line_and_exit_code_1(command):
    port = closed_port()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = runner.invoke(app, [*command, "--bootstrap", f"127.0.0.1:{port}"])
        gc.collect()
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no Kafka broker let this client in"), lines
    assert f"127.0.0.1:{port}" in lines[0] and "Connect call failed" in lines[0]
    assert not [w for w in caught if "never awaited" in str(w.message) or "Unclosed" in str(w.message)]


def test_clients_that_fail_to_start_close_what_they_opened():
    server = f"127.0.0.1:{closed_port()}"

    async def start(make):
        client = make()
        with pytest.raises(Exception, match="Unable to bootstrap"):
            async with client:
                raise AssertionError("started against a closed port")
        return client

    producer = asyncio.run(start(lambda: RequestProducer(server, request_timeout_ms=2000)))
    reader = asyncio.run(start(lambda: TopicReader(server, "t", request_timeout_ms=2000)))
    # aiokafka warns "Unclosed AIOKafkaProducer/Consumer" when one is collected unstopped.
    assert producer._producer.producer._closed and reader._consumer._closed


def test_consume_timeout_counts_idle_seconds(monkeypatch):
    """--timeout stops after that long without a record: records that keep coming keep the reader going."""
    clock = [0.0]
    arrivals = {0.4, 0.8, 1.2, 1.6, 2.0}  # one record every 0.4 s, against a 1 s idle timeout

    class Consumer:
        async def getmany(self, timeout_ms: int):
            clock[0] = round(clock[0] + 0.2, 1)
            return {"tp": [f"record at {clock[0]}"]} if clock[0] in arrivals else {}

    monkeypatch.setattr(client_module.time, "monotonic", lambda: clock[0])
    reader = TopicReader.__new__(TopicReader)
    reader._consumer = Consumer()

    async def read() -> list[str]:
        return [rec async for rec in reader.records(1.0)]

    assert asyncio.run(read()) == [f"record at {t}" for t in sorted(arrivals)]
    assert clock[0] == pytest.approx(3.0)  # the last record came at 2.0; one idle second later it stopped


def test_produce_stream_prints_what_a_client_should_show(monkeypatch, capsys):
    """A restart delta, and a second index 0 (the request moved to another worker), each start the text again,
    visibly; a stream that failed says so; another request's deltas are not shown."""
    from cli.client import _print_deltas
    from schemas import Delta, encode

    deltas = [Delta(id="c1", index=0, text="Bad"), Delta(id="other", index=0, text="NOT MINE"),
              Delta(id="c1", index=1, text="", restart=True), Delta(id="c1", index=2, text="Go"),
              Delta(id="c1", index=0, text="Good"), Delta(id="c1", index=1, text="!", finished=True,
                                                          finish_reason="error"),
              Delta(id="c1", index=2, text="after the end")]

    monkeypatch.setattr(client_module, "TopicReader", reader_of([encode(d, "json") for d in deltas]))
    asyncio.run(_print_deltas("broker", {}, "deltas", "c1", 5.0, asyncio.Event()))
    assert capsys.readouterr().err == (
        "Bad\n[the answer broke a rule; generating it again]\nGo"
        "\n[the request moved to another worker; its answer starts again]\nGood!"
        "\n[stream ended by an error; the result says why]\n")


def test_stream_text_applies_restarts_duplicates_and_gaps():
    from schemas import Delta
    from worker.client import StreamText

    stream = StreamText()
    events = [stream.add(d) for d in (
        Delta(id="c", index=0, text="Bad"), Delta(id="c", index=1, text=" one"),
        Delta(id="c", index=1, text=" one"),  # a duplicate: nothing changes
        Delta(id="c", index=2, restart=True), Delta(id="c", index=3, text="Good"))]
    assert events == ["", "", "", "restart", ""] and (stream.text, stream.missing) == ("Good", 0)
    assert stream.add(Delta(id="c", index=0, text="Go")) == "moved" and stream.text == "Go"
    assert stream.add(Delta(id="c", index=3, text="!", finished=True, finish_reason="stop")) == ""
    assert (stream.text, stream.missing, stream.finished, stream.finish_reason) == ("Go!", 2, True, "stop")


CHAT_FILE = b'{"kind": "chat", "messages": [{"role": "user", "content": "hi"}]}'


@pytest.mark.parametrize(("args", "says"), [
    (["--text", "hi", "--kind", "asr", "--system", "Be brief."], "--system applies to chat requests, not to --kind asr"),
    (["--text", "hi", "--kind", "risk", "--top-logprobs", "2"], "--top-logprobs applies to chat requests, not to --kind risk"),
    (["--text", "hi", "--item", "more"], "--item applies to risk requests, not to --kind chat"),
    (["--text", "hi", "--kind", "chat", "--final"], "--final applies to asr requests, not to --kind chat"),
    (["--file", "FILE", "--seed", "3"], "--seed does not apply to --file, which is sent as written: put it in the file"),
    (["--file", "FILE", "--stream"], "--stream does not apply to --file"),
    (["--file", "FILE", "--kind", "asr"], "not sent: --kind asr, but the file holds a chat request"),
    (["--text", "hi", "--kind", "summary"], "unknown kind 'summary': use chat, asr or risk"),
])
def test_an_option_the_request_would_not_carry_is_refused_not_dropped(tmp_path, args, says):
    request = tmp_path / "request.json"
    request.write_bytes(CHAT_FILE)
    args = [str(request) if a == "FILE" else a for a in args]
    result = runner.invoke(app, ["produce", *args, "--bootstrap", f"127.0.0.1:{closed_port()}"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().startswith(says) and result.stdout == "", result.stderr


def _sent_request(monkeypatch, args: list[str]):
    """The request `produce` would send for these arguments (the broker part replaced by a recorder)."""
    from cli import client as cli_client

    sent = []

    async def produce(cfg, topic, req, *rest, **kwargs):
        sent.append((topic, req))

    monkeypatch.setattr(cli_client, "_produce", produce)
    monkeypatch.setattr(cli_client, "_talk", lambda cfg, work: asyncio.run(work))
    result = runner.invoke(app, ["produce", *args])
    assert result.exit_code == 0 and len(sent) == 1, result.output
    return sent[0]


def test_produce_sends_a_system_message_and_asks_for_logprobs(monkeypatch):
    from schemas import Message

    topic, req = _sent_request(monkeypatch, ["--text", "Say hi.", "--system", "Be brief.", "--top-logprobs", "3"])
    assert topic.endswith(".chat") and req.messages == [Message(role="system", content="Be brief."),
                                                        Message(role="user", content="Say hi.")]
    assert (req.logprobs, req.top_logprobs) == (True, 3)  # --top-logprobs implies --logprobs, as the field needs
    _, req = _sent_request(monkeypatch, ["--text", "Say hi.", "--logprobs"])
    assert (req.logprobs, req.top_logprobs, len(req.messages)) == (True, 0, 1)
    _, req = _sent_request(monkeypatch, ["--text", "Say hi."])
    assert (req.logprobs, req.top_logprobs, req.messages[0].role) == (False, 0, "user")


def test_consume_id_prints_only_those_requests_and_stops_when_each_has_ended(monkeypatch, capsys):
    from cli.client import _config, _consume
    from schemas import Delta, Result, encode

    consumed: list[bytes] = []
    results = [encode(Result(id=i, kind="chat", text=i), "json") for i in ("a", "other", "b", "after")]
    results.insert(1, b"not a result")
    monkeypatch.setattr(client_module, "TopicReader", reader_of(results, consumed))
    cfg = _config(None, None)
    asyncio.run(_consume(cfg, "results", "results", True, None, 1.0, {"a", "b"}))
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["id"], r["text"]) for r in printed] == [("a", "a"), ("b", "b")]
    assert len(consumed) == 4  # it stopped at b's result, not at the reader's timeout

    consumed.clear()
    deltas = [Delta(id="a", index=0, text="x"), Delta(id="b", index=0, text="y"),
              Delta(id="a", index=1, text="z", finished=True, finish_reason="stop"), Delta(id="a", index=2, text="!")]
    monkeypatch.setattr(client_module, "TopicReader", reader_of([encode(d, "json") for d in deltas], consumed))
    asyncio.run(_consume(cfg, "deltas", "deltas", True, None, 1.0, {"a"}))
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(d["id"], d["index"]) for d in printed] == [("a", 0), ("a", 1)] and len(consumed) == 3


def test_consume_id_is_for_results_and_deltas():
    result = runner.invoke(app, ["consume", "--topic", "dlq", "--id", "x", "--bootstrap", f"127.0.0.1:{closed_port()}"])
    assert result.exit_code == 2
    assert result.stderr.strip() == "--id picks records of the results or deltas topic, not of dlq"

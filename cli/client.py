"""`infinilm produce` and `infinilm consume`: talk to the topics like a client would."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import uuid
from pathlib import Path

import msgspec
import typer

CONFIG_HELP = "config.yaml with the topic names and Kafka client settings (env INFINILM__* overrides it)."


def _config(path: Path | None, bootstrap: str | None):
    from worker.config import load_config
    from worker.config_types import ConfigError

    try:
        cfg = load_config(path)
    except ConfigError as exc:
        typer.echo(f"config error: {exc}", err=True)
        raise typer.Exit(2) from exc
    if bootstrap:
        cfg = msgspec.structs.replace(cfg, kafka=msgspec.structs.replace(cfg.kafka, bootstrap_servers=bootstrap))
    return cfg


def _kwargs(cfg) -> dict:
    from worker.kafka_clients import client_kwargs

    kwargs = client_kwargs(cfg.kafka)
    kwargs.pop("client_id", None)
    return kwargs


def _talk(cfg, work):
    """Run `work` (a coroutine) against the broker; a broker that cannot be reached or a missing topic
    is one line on stderr and exit code 1, never a traceback."""
    from aiokafka.errors import KafkaError

    from worker.client import MissingTopicError
    from worker.kafka_clients import KafkaAccessError, check_kafka_access

    async def checked():
        # aiokafka's own start-up says only "Unable to bootstrap"; this check says why.
        await check_kafka_access(cfg.kafka, "infinilm-cli")
        return await work

    try:
        return asyncio.run(checked())
    except (KafkaAccessError, MissingTopicError) as exc:
        typer.echo(f"error: {exc}", err=True)
    except KafkaError as exc:
        typer.echo(f"error: Kafka at {cfg.kafka.bootstrap_servers}: {exc}", err=True)  # names its type
    finally:
        work.close()  # a coroutine the check kept from starting would warn that it was never awaited
    raise typer.Exit(1)


def _as_json(obj) -> str:
    return json.dumps(msgspec.to_builtins(obj), ensure_ascii=False)


def register(app: typer.Typer) -> None:
    @app.command(help="Produce one request to its topic, from options (--text) or written out in full (--file); "
                      "with --wait, print its committed result.")
    def produce(
        kind: str | None = typer.Option(None, help="chat, asr or risk (default chat; with --file, the file's)."),
        text: str | None = typer.Option(None, "--text", "-t", help="chat: the user message; asr: the chunk; risk: an item (repeat with --item)."),
        file: Path | None = typer.Option(
            None, "--file", "-f", help="A request as JSON, every field as the topic takes it (README, Topics; "
            "- reads stdin), sent as written: the options for --text are refused beside it, and a chat request with "
            "\"stream\": true prints its deltas. --id replaces its `id`, and one is added if it has none; keys "
            "the worker would not read are refused (see --allow-unknown)."),
        allow_unknown: bool = typer.Option(False, "--allow-unknown", help="--file: send a request whose keys the "
                                           "worker would not read (it names them in the result's ignored_fields)."),
        request_id: str | None = typer.Option(None, "--id", help="Request id (default: a new uuid)."),
        max_tokens: int = typer.Option(128, "--max-tokens", help="chat: most tokens to generate."),
        temperature: float = typer.Option(0.0, help="chat: 0 is greedy; higher is more random."),
        seed: int | None = typer.Option(None, help="chat: seed for reproducible sampling."),
        system: str | None = typer.Option(None, "--system", help="chat: a system message, sent before --text."),
        logprobs: bool = typer.Option(False, "--logprobs", help="chat: the result lists each generated token "
                                      "with its log-probability."),
        top_logprobs: int = typer.Option(0, "--top-logprobs", help="chat: also the N likeliest tokens at each "
                                         "position (0-20; implies --logprobs)."),
        stream: bool = typer.Option(False, "--stream", help="chat: also print token deltas as they arrive."),
        stream_id: str | None = typer.Option(None, "--stream-id", help="asr: the stream this chunk belongs to."),
        seq: int = typer.Option(0, help="asr: chunk sequence number."),
        final: bool = typer.Option(False, help="asr: last chunk of the stream."),
        item: list[str] = typer.Option([], "--item", help="risk: more texts to score (repeatable)."),
        label: list[str] = typer.Option([], "--label", help="risk: candidate labels (repeatable)."),
        fmt: str = typer.Option("json", "--format", help="Wire format: json or msgpack."),
        wait: bool = typer.Option(False, "--wait", help="Wait for the committed result and print it."),
        timeout: float = typer.Option(120.0, help="Seconds to wait with --wait."),
        config: Path | None = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
        bootstrap: str | None = typer.Option(None, "--bootstrap", help="Override kafka.bootstrap_servers."),
    ) -> None:
        from schemas import (
            AsrRequest,
            ChatRequest,
            Message,
            RiskItem,
            RiskRequest,
            SchemaError,
            validate_request,
        )
        from worker.client import CONTENT_TYPES

        if fmt not in CONTENT_TYPES:
            typer.echo(f"--format must be json or msgpack, got {fmt!r}", err=True)
            raise typer.Exit(2)
        if (text is None) == (file is None):
            typer.echo("give the request as --text (with the options for it) or as --file, one of the two", err=True)
            raise typer.Exit(2)
        if kind not in (None, "chat", "asr", "risk"):
            typer.echo(f"unknown kind {kind!r}: use chat, asr or risk", err=True)
            raise typer.Exit(2)
        if file is None and kind is None:
            kind = "chat"
        given = {"chat": {"--max-tokens": max_tokens != 128, "--temperature": temperature != 0.0,
                          "--seed": seed is not None, "--system": system is not None, "--logprobs": logprobs,
                          "--top-logprobs": top_logprobs != 0, "--stream": stream},
                 "asr": {"--stream-id": stream_id is not None, "--seq": seq != 0, "--final": final},
                 "risk": {"--item": bool(item), "--label": bool(label)}}
        # An option the request would not carry is an error, not a silent no-op.
        for owner, flags in given.items():
            for flag in (f for f, set_ in flags.items() if set_):
                if file is not None:
                    typer.echo(f"{flag} does not apply to --file, which is sent as written: put it in the file",
                               err=True)
                    raise typer.Exit(2)
                if owner != kind:
                    typer.echo(f"{flag} applies to {owner} requests, not to --kind {kind}", err=True)
                    raise typer.Exit(2)
        cfg = _config(config, bootstrap)
        rid = request_id or str(uuid.uuid4())
        if file is not None:
            req, raw = _request_from_file(file, request_id, allow_unknown)
            if kind is not None and kind != req.kind:
                typer.echo(f"not sent: --kind {kind}, but the file holds a {req.kind} request", err=True)
                raise typer.Exit(2)
            topic = cfg.topics.request_topics[req.kind]
            # JSON goes out as written (unknown keys included, when allowed); msgpack from the decoded request.
            result = _talk(cfg, _produce(cfg, topic, req, fmt, wait, req.kind == "chat" and req.stream, timeout,
                                         payload=raw if fmt == "json" else None))
            if wait and result is None:
                typer.echo(f"no result for {req.id} within {timeout:.0f}s (is a worker running?)", err=True)
                raise typer.Exit(1)
            return
        if kind == "chat":
            messages = [Message(role="system", content=system)] if system is not None else []
            req = ChatRequest(id=rid, messages=[*messages, Message(role="user", content=text)],
                              max_tokens=max_tokens, temperature=temperature, seed=seed, stream=stream,
                              logprobs=logprobs or top_logprobs > 0, top_logprobs=top_logprobs)
        elif kind == "asr":
            req = AsrRequest(id=rid, stream_id=stream_id or rid, seq=seq, text=text, final=final)
        else:
            texts = [text, *item]
            req = RiskRequest(id=rid, items=[RiskItem(id=str(i), text=t) for i, t in enumerate(texts)],
                              labels=list(label))  # none: the worker's risk.default_labels
        try:
            validate_request(req)  # what a worker would answer with invalid_request, said before sending
        except SchemaError as exc:
            typer.echo(f"not sent: {exc}", err=True)
            raise typer.Exit(2) from None
        topic = cfg.topics.request_topics[kind]
        result = _talk(cfg, _produce(cfg, topic, req, fmt, wait, stream, timeout))
        if wait and result is None:
            typer.echo(f"no result for {rid} within {timeout:.0f}s (is a worker running?)", err=True)
            raise typer.Exit(1)

    @app.command(help="Print records from a topic (results by default) as JSON lines.")
    def consume(
        topic: str = typer.Option("results", help="results, deltas, dlq, or a full topic name."),
        from_beginning: bool = typer.Option(False, "--from-beginning",
                                            help="Start at the oldest record, not at new ones."),
        limit: int | None = typer.Option(None, "--max", help="Stop after this many records."),
        timeout: float | None = typer.Option(None, help="Stop after this many idle seconds (default: run until Ctrl-C)."),
        ids: list[str] = typer.Option([], "--id", help="results or deltas: only these requests' records "
                                      "(repeatable); stops once each has its result, or its last delta."),
        config: Path | None = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
        bootstrap: str | None = typer.Option(None, "--bootstrap", help="Override kafka.bootstrap_servers."),
    ) -> None:
        role = topic if topic in ("results", "deltas", "dlq") else None
        if ids and role not in ("results", "deltas"):
            typer.echo(f"--id picks records of the results or deltas topic, not of {topic}", err=True)
            raise typer.Exit(2)
        cfg = _config(config, bootstrap)
        name = getattr(cfg.topics, topic) if role else topic
        with contextlib.suppress(KeyboardInterrupt):
            _talk(cfg, _consume(cfg, name, role, from_beginning, limit, timeout, set(ids)))


# How long `produce --stream` goes on reading deltas after the result came (deltas are best effort).
DELTA_GRACE_S = 2.0


def _request_from_file(path: Path, request_id: str | None, allow_unknown: bool):
    """The request in a JSON file (or stdin for -), checked as a worker checks it: (request, JSON bytes)."""
    from schemas import SchemaError, decode_request, unknown_request_fields

    try:
        raw = sys.stdin.buffer.read() if str(path) == "-" else path.read_bytes()
    except OSError as exc:
        typer.echo(f"cannot read {path}: {exc.strerror or exc}", err=True)
        raise typer.Exit(2) from None
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        typer.echo(f"not sent: {path} is not JSON: {exc}", err=True)
        raise typer.Exit(2) from None
    if not isinstance(body, dict):
        typer.echo(f"not sent: {path} must hold one JSON object (a request), not a {type(body).__name__}", err=True)
        raise typer.Exit(2)
    if request_id is not None or "id" not in body:
        body["id"] = request_id or str(uuid.uuid4())
        raw = msgspec.json.encode(body)
    try:
        req = decode_request(raw, "application/json")
    except SchemaError as exc:
        typer.echo(f"not sent: {exc}", err=True)
        raise typer.Exit(2) from None
    unknown = unknown_request_fields(raw, "application/json", req)
    if unknown and not allow_unknown:
        names = ", ".join(f.describe() for f in unknown)
        typer.echo(f"not sent: the worker would not read {names}; fix them, or send anyway with --allow-unknown",
                   err=True)
        raise typer.Exit(2)
    return req, raw


async def _produce(cfg, topic, req, fmt, wait, stream, timeout, payload: bytes | None = None):
    """Send `req`, or `payload` in its place (the request's JSON as written); with `wait`, return its result."""
    from worker.client import RequestProducer, TopicReader, collect_results

    kwargs = _kwargs(cfg)
    servers = kwargs.pop("bootstrap_servers")
    # Keyed as RequestProducer keys a request: an asr chunk by its stream, so the stream stays in order.
    key = getattr(req, "stream_id", None) or req.id
    sent = req if payload is None else payload
    if not wait:
        async with RequestProducer(servers, **kwargs) as producer:
            await producer.send(topic, sent, fmt, key=key)
        typer.echo(f"sent {req.id} to {topic}")
        return None
    async with TopicReader(servers, cfg.topics.results, **kwargs) as results:
        deltas_task = None
        if stream:
            # The request goes out only once the deltas reader holds its start offsets: a delta written
            # before that would be missed.
            positioned = asyncio.Event()
            deltas_task = asyncio.create_task(
                _print_deltas(servers, kwargs, cfg.topics.deltas, req.id, timeout, positioned))
            waiter = asyncio.create_task(positioned.wait())
            await asyncio.wait({deltas_task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        async with RequestProducer(servers, **kwargs) as producer:
            await producer.send(topic, sent, fmt, key=key)
        got = await collect_results(results, [req.id], timeout)
        if deltas_task:
            # Deltas and results are separate topics: the last deltas may be read after the result.
            await asyncio.wait({deltas_task}, timeout=DELTA_GRACE_S)
            deltas_task.cancel()
    if req.id not in got:
        return None
    result = got[req.id][0]
    typer.echo(_as_json(result))
    return result


async def _print_deltas(servers, kwargs, topic, rid, timeout, positioned: asyncio.Event):
    from schemas import decode_delta
    from worker import client

    notes = {"restart": "\n[the answer broke a rule; generating it again]\n",
             "moved": "\n[the request moved to another worker; its answer starts again]\n"}
    async with client.TopicReader(servers, topic, **kwargs) as reader:
        positioned.set()
        stream = client.StreamText()
        async for rec in reader.records(timeout):
            delta = decode_delta(rec.value)
            if delta.id != rid:
                continue
            before = len(stream.text)
            event = stream.add(delta)
            sys.stderr.write(notes[event] + stream.text if event else stream.text[before:])
            if stream.finished:
                sys.stderr.write("\n[stream ended by an error; the result says why]\n"
                                 if stream.finish_reason == "error" else "\n")
            sys.stderr.flush()
            if stream.finished:
                return


async def _consume(cfg, topic, role, from_beginning, limit, timeout, ids: frozenset[str] | set[str] = frozenset()):
    """Print the topic's records; with `ids` (results or deltas only), just those requests' records, until
    each has its result or its last delta."""
    from schemas import SchemaError, decode_dead_letter, decode_delta, decode_result
    from worker.client import TopicReader

    kwargs = _kwargs(cfg)
    servers = kwargs.pop("bootstrap_servers")
    decoder = {"results": decode_result, "deltas": decode_delta, "dlq": decode_dead_letter}.get(role)
    count = 0
    open_ids = set(ids)
    async with TopicReader(servers, topic, from_beginning=from_beginning, **kwargs) as reader:
        async for rec in reader.records(timeout):
            try:
                record = decoder(rec.value) if decoder else None
                line = _as_json(record) if decoder else rec.value.decode("utf-8", "replace")
            except SchemaError as exc:
                if ids:
                    continue  # not known to be one of them
                line = json.dumps({"undecodable": str(exc), "offset": rec.offset})
            if ids:
                if record.id not in ids:
                    continue
                if role == "results" or record.finished:
                    open_ids.discard(record.id)
            typer.echo(line)
            count += 1
            if (limit is not None and count >= limit) or (ids and not open_ids):
                return

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


def _config(path: Path | None):
    from worker.config import load_config
    from worker.config_types import ConfigError

    try:
        return load_config(path)
    except ConfigError as exc:
        typer.echo(f"config error: {exc}", err=True)
        raise typer.Exit(2) from exc


def _kwargs(cfg, bootstrap: str | None) -> dict:
    from worker.kafka_clients import client_kwargs

    kwargs = client_kwargs(cfg.kafka)
    if bootstrap:
        kwargs["bootstrap_servers"] = bootstrap
    return kwargs


def _as_json(obj) -> str:
    return json.dumps(msgspec.to_builtins(obj), ensure_ascii=False)


def register(app: typer.Typer) -> None:
    @app.command(help="Produce one request to its topic; with --wait, print its committed result.")
    def produce(
        kind: str = typer.Option("chat", help="chat, asr or risk."),
        text: str = typer.Option(..., "--text", "-t", help="chat: the user message; asr: the chunk; risk: an item (repeat with --item)."),
        request_id: str | None = typer.Option(None, "--id", help="Request id (default: a new uuid)."),
        max_tokens: int = typer.Option(128, "--max-tokens"),
        temperature: float = typer.Option(0.0),
        seed: int | None = typer.Option(None),
        stream: bool = typer.Option(False, "--stream", help="chat: also print token deltas as they arrive."),
        stream_id: str | None = typer.Option(None, "--stream-id", help="asr: the stream this chunk belongs to."),
        seq: int = typer.Option(0, help="asr: chunk sequence number."),
        final: bool = typer.Option(False, help="asr: last chunk of the stream."),
        item: list[str] = typer.Option([], "--item", help="risk: more texts to score (repeatable)."),
        label: list[str] = typer.Option([], "--label", help="risk: candidate labels (repeatable)."),
        fmt: str = typer.Option("json", "--format", help="Wire format: json or msgpack."),
        wait: bool = typer.Option(False, "--wait", help="Wait for the committed result and print it."),
        timeout: float = typer.Option(120.0, help="Seconds to wait with --wait."),
        config: Path | None = typer.Option(None, "--config", "-c"),
        bootstrap: str | None = typer.Option(None, "--bootstrap", help="Override kafka.bootstrap_servers."),
    ) -> None:
        from schemas import AsrRequest, ChatRequest, Message, RiskItem, RiskRequest

        cfg = _config(config)
        rid = request_id or str(uuid.uuid4())
        if kind == "chat":
            req = ChatRequest(id=rid, messages=[Message(role="user", content=text)], max_tokens=max_tokens,
                              temperature=temperature, seed=seed, stream=stream)
        elif kind == "asr":
            req = AsrRequest(id=rid, stream_id=stream_id or rid, seq=seq, text=text, final=final)
        elif kind == "risk":
            texts = [text, *item]
            req = RiskRequest(id=rid, items=[RiskItem(id=str(i), text=t) for i, t in enumerate(texts)],
                              labels=label or list(cfg.risk.default_labels))
        else:
            typer.echo(f"unknown kind {kind!r}: use chat, asr or risk", err=True)
            raise typer.Exit(2)
        topic = cfg.topics.request_topics[kind]
        result = asyncio.run(_produce(cfg, bootstrap, topic, req, fmt, wait, stream, timeout))
        if wait and result is None:
            typer.echo(f"no result for {rid} within {timeout:.0f}s (is a worker running?)", err=True)
            raise typer.Exit(1)

    @app.command(help="Print records from a topic (results by default) as JSON lines.")
    def consume(
        topic: str = typer.Option("results", help="results, deltas, dlq, or a full topic name."),
        from_beginning: bool = typer.Option(False, "--from-beginning"),
        limit: int | None = typer.Option(None, "--max", help="Stop after this many records."),
        timeout: float | None = typer.Option(None, help="Stop after this many idle seconds (default: run until Ctrl-C)."),
        config: Path | None = typer.Option(None, "--config", "-c"),
        bootstrap: str | None = typer.Option(None, "--bootstrap"),
    ) -> None:
        cfg = _config(config)
        role = topic if topic in ("results", "deltas", "dlq") else None
        name = getattr(cfg.topics, topic) if role else topic
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_consume(cfg, bootstrap, name, role, from_beginning, limit, timeout))


async def _produce(cfg, bootstrap, topic, req, fmt, wait, stream, timeout):
    from worker.client import RequestProducer, TopicReader, collect_results

    kwargs = _kwargs(cfg, bootstrap)
    servers = kwargs.pop("bootstrap_servers")
    kwargs.pop("client_id", None)
    if not wait:
        async with RequestProducer(servers, **kwargs) as producer:
            await producer.send(topic, req, fmt)
        typer.echo(f"sent {req.id} to {topic}")
        return None
    async with TopicReader(servers, cfg.topics.results, **kwargs) as results:
        deltas_task = None
        if stream:
            deltas_task = asyncio.create_task(_print_deltas(servers, kwargs, cfg.topics.deltas, req.id, timeout))
            await asyncio.sleep(0.5)
        async with RequestProducer(servers, **kwargs) as producer:
            await producer.send(topic, req, fmt)
        got = await collect_results(results, [req.id], timeout)
        if deltas_task:
            deltas_task.cancel()
    if req.id not in got:
        return None
    result = got[req.id][0]
    typer.echo(_as_json(result))
    return result


async def _print_deltas(servers, kwargs, topic, rid, timeout):
    from schemas import decode_delta
    from worker.client import TopicReader

    async with TopicReader(servers, topic, **kwargs) as reader:
        async for rec in reader.records(timeout):
            delta = decode_delta(rec.value)
            if delta.id == rid:
                sys.stderr.write(delta.text)
                sys.stderr.flush()
                if delta.finished:
                    sys.stderr.write("\n")
                    return


async def _consume(cfg, bootstrap, topic, role, from_beginning, limit, timeout):
    from schemas import SchemaError, decode_dead_letter, decode_delta, decode_result
    from worker.client import TopicReader

    kwargs = _kwargs(cfg, bootstrap)
    servers = kwargs.pop("bootstrap_servers")
    kwargs.pop("client_id", None)
    decoder = {"results": decode_result, "deltas": decode_delta, "dlq": decode_dead_letter}.get(role)
    count = 0
    async with TopicReader(servers, topic, from_beginning=from_beginning, **kwargs) as reader:
        async for rec in reader.records(timeout):
            try:
                line = _as_json(decoder(rec.value)) if decoder else rec.value.decode("utf-8", "replace")
            except SchemaError as exc:
                line = json.dumps({"undecodable": str(exc), "offset": rec.offset})
            typer.echo(line)
            count += 1
            if limit is not None and count >= limit:
                return

"""`infinilm demo`: the whole path on this machine, with real requests.

Brings up Kafka and Redis, prepares the SmolLM2 demo model, starts a worker in
this process, sends chat requests (JSON and msgpack, one streamed, one with a
picture it draws, one with a misspelt key), ASR chunks and a risk batch, plus bad
input to show it is answered rather than dropped, and prints the committed
results and a metrics summary. Exits 1 when a request got no result.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

console = Console(stderr=False)


def register(app: typer.Typer) -> None:
    @app.command(help="Bring up Kafka + Redis, start a worker, send real requests and print the results.")
    def demo(
        config: Path | None = typer.Option(None, "--config", "-c", help="config.yaml for the worker."),
        keep_stack: bool = typer.Option(True, help="Leave Kafka and Redis running afterwards."),
    ) -> None:
        from worker.config import load_config
        from worker.config_types import ConfigError

        try:
            cfg = load_config(config)
        except ConfigError as exc:
            typer.echo(f"config error: {exc}", err=True)
            raise typer.Exit(2) from exc
        asyncio.run(_demo(cfg, keep_stack))


def _stack_up(cfg) -> None:
    from devstack import StackConfig, stack_up

    with console.status("starting Kafka and Redis (the first run downloads Kafka from Maven Central)..."):
        status = stack_up(StackConfig(), progress=lambda msg: console.log(msg))
    console.print(f"[green]stack up[/]: kafka {status.kafka.detail}, redis {status.redis.detail}")


async def _demo(cfg, keep_stack: bool) -> None:
    import msgspec

    from engine.model_registry import resolve_model
    from schemas import (
        AsrRequest,
        ChatRequest,
        ImagePart,
        Message,
        RiskItem,
        RiskRequest,
        TextPart,
        decode_delta,
    )
    from worker.client import RequestProducer, StreamText, TopicReader, collect_results, start_group_at_end
    from worker.service import Worker
    from worker.structured_logging import configure_logging

    _stack_up(cfg)
    with console.status("preparing the SmolLM2-135M demo model..."):
        path = resolve_model(cfg.model.name)
    console.print(f"model: {path}")
    configure_logging("warning", "console")
    # The demo's console shows what a user should look at. Kafka 4's retriable KIP-890 answer to a
    # transaction's first write (docs/operations.md, troubleshooting) is retried and harmless: not here.
    logging.getLogger("aiokafka.producer.sender").addFilter(
        lambda rec: "NotEnoughReplicasError" not in rec.getMessage())
    # A demo group of its own, so a worker from an earlier run can't take our partitions. It starts at
    # the request topics' current end: a new group would otherwise serve every earlier run's requests.
    run_id = uuid.uuid4().hex[:8]
    cfg = msgspec.structs.replace(cfg, kafka=msgspec.structs.replace(cfg.kafka, group_id=f"infinilm-demo-{run_id}"),
                                  metrics=msgspec.structs.replace(cfg.metrics, port=0))
    await start_group_at_end(cfg.kafka.bootstrap_servers, cfg.kafka.group_id, cfg.topics.request_topics.values())
    with console.status("loading the engine and joining the consumer group..."):
        worker = Worker(cfg, f"demo-{run_id}")
        await worker.start()
        for _ in range(200):
            if worker.consumer.assignment():
                break
            await asyncio.sleep(0.1)
    console.print(f"worker [bold]{worker.worker_id}[/] serving {sorted(cfg.topics.request_topics.values())}; "
                  f"metrics on http://127.0.0.1:{worker.http.port}/metrics")

    questions = [
        ("json", "What is the capital of France?"),
        ("msgpack", "Give me three tips for writing clear emails."),
        ("json", "Explain in one sentence what Apache Kafka does."),
    ]
    requests = [ChatRequest(id=f"demo-{run_id}-{i}", messages=[Message(role="user", content=q)], max_tokens=64,
                            temperature=0.0, stream=(i == 0)) for i, (_, q) in enumerate(questions)]
    ruled = ChatRequest(id=f"demo-{run_id}-rules", messages=[Message(role="user", content="What is 12 times 12?")],
                        max_tokens=48, temperature=0.0, rules=["forbid: 144", "Answer in words, not digits."])
    stream_id = f"call-{run_id}"
    chunks = [AsrRequest(id=f"demo-{run_id}-asr{i}", stream_id=stream_id, seq=i, text=t) for i, t in enumerate(
        ["so um the meeting is moved to tuesday", "at ten thirty in the main conference room"])]
    risk = RiskRequest(id=f"demo-{run_id}-risk", labels=["low", "medium", "high"], items=[
        RiskItem(id="tx1", text="Wire of $9,900 to a new overseas account, the third one today."),
        RiskItem(id="tx2", text="Monthly rent payment to the usual landlord.")])
    image_req = ChatRequest(id=f"demo-{run_id}-image", max_tokens=32, temperature=0.0, messages=[Message(
        role="user", content=[TextPart(text="What is in this picture?"), ImagePart(image=_drawn_picture())])])
    # A typo'd key (max_token): served, and the result names the key it did not read.
    typo_id = f"demo-{run_id}-typo"
    typo = msgspec.json.encode({"id": typo_id, "kind": "chat", "max_token": 8, "temperature": 0.0,
                                "messages": [{"role": "user", "content": "Say hello."}]})
    bad_id = f"demo-{run_id}-too-long"
    too_long = ChatRequest(id=bad_id, messages=[Message(role="user", content="word " * 9000)], max_tokens=16)
    everything = [*requests, ruled, image_req, *chunks, risk, too_long]
    ids = [r.id for r in everything] + [typo_id]
    kwargs = {"bootstrap_servers": cfg.kafka.bootstrap_servers}
    started = time.perf_counter()
    async with TopicReader(topic=cfg.topics.results, **kwargs) as results, \
            TopicReader(topic=cfg.topics.dlq, **kwargs) as dlq, \
            TopicReader(topic=cfg.topics.deltas, **kwargs) as deltas:
        async with RequestProducer(**kwargs) as producer:
            for (fmt, _), req in zip(questions, requests, strict=True):
                await producer.send(cfg.topics.chat, req, fmt)
            await producer.send(cfg.topics.chat, ruled, "json")
            await producer.send(cfg.topics.chat, image_req, "msgpack")  # the PNG travels as raw msgpack bytes
            for chunk in chunks:
                await producer.send(cfg.topics.asr, chunk, "json")
            await producer.send(cfg.topics.risk, risk, "msgpack")
            await producer.send(cfg.topics.chat, too_long, "json")
            await producer.send(cfg.topics.chat, typo, "json", key=typo_id)
            await producer.send(cfg.topics.chat, b"\x00\xffnot a request at all", "raw", key="garbage")
        with console.status("waiting for committed results (read_committed)..."):
            got = await collect_results(results, ids, timeout_s=600)
            dead = [rec async for rec in dlq.records(5.0)]
            streamed = StreamText()
            async for rec in deltas.records(2.0):
                if (delta := decode_delta(rec.value)).id == requests[0].id:
                    streamed.add(delta)
    elapsed = time.perf_counter() - started

    table = Table(title="committed results", show_lines=True)
    table.add_column("id", overflow="fold")  # whole, to grep the results topic for
    for col in ("status", "text / error", "tokens", "ttft ms", "total ms"):
        table.add_column(col)
    for rid in ids:
        res = got.get(rid, [None])[0]
        if res is None:
            table.add_row(rid, "[red]missing[/]", "", "", "", "")
            continue
        body = _describe(res)
        # Model text and the [chunk n] / [so far] labels are data, not rich markup.
        table.add_row(escape(res.id), res.status, escape(body), f"{res.usage.prompt_tokens}+{res.usage.completion_tokens}",
                      f"{res.timing.ttft_ms:.0f}", f"{res.timing.total_ms:.0f}")
    console.print(table)
    console.print(f"dead-letter records for undecodable input: {len(dead)}")
    first = got.get(requests[0].id, [None])[0]
    same = first is not None and streamed.finished and streamed.text == first.text
    console.print(f"{requests[0].id} streamed its answer to {cfg.topics.deltas}: the deltas add up to "
                  f"{'the' if same else '[red]not the[/]'} result's text")
    if worker.engine.model_config.vision is None:
        console.print("The image request asks a text-only model, so it is refused with invalid_request; set "
                      "model.name to a LLaVA folder (README, Images) to have it answered.")
    _print_metrics(worker)
    missing = [rid for rid in ids if rid not in got]
    if missing:
        console.print(f"[red]{len(missing)} of {len(ids)} requests got no result in time: {missing}[/]")
    else:
        console.print(f"all answered in {elapsed:.1f}s")
    await worker.shutdown()
    if not keep_stack:
        from devstack import StackConfig, stack_down

        stack_down(StackConfig())
    else:
        console.print("Kafka and Redis are still running: `infinilm stack down` stops them.")
    if missing:
        raise typer.Exit(1)


def _drawn_picture() -> bytes:
    """A PNG the demo draws: a sun over a green hill under a blue sky."""
    import io

    from PIL import Image, ImageDraw

    image = Image.new("RGB", (320, 240), (110, 170, 235))
    draw = ImageDraw.Draw(image)
    draw.ellipse((-80, 150, 400, 420), fill=(70, 150, 60))
    draw.ellipse((230, 25, 290, 85), fill=(255, 215, 0))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _describe(res) -> str:
    if res.status != "ok":
        return f"{res.error.code}: {res.error.message[:80]}"
    if res.kind == "risk":
        return "; ".join(f"{it.id}: {it.label} ({it.scores[it.label]:.2f})" for it in res.items)
    if res.kind == "asr":
        return f"[chunk {res.seq}] {res.text}\n[so far] {res.committed_text}"
    if res.compliance is not None:
        verdict = "rules passed" if res.compliance.passed else \
            "rules broken: " + ", ".join(v.rule for v in res.compliance.violations)
        return f"{res.text}\n[{verdict}]"
    if res.ignored_fields:
        return f"{res.text}\n[ignored: {', '.join(res.ignored_fields)}]"
    return res.text


def _print_metrics(worker) -> None:
    registry = worker.metrics.registry
    wanted = {
        "infinilm_requests_total": "requests",
        "infinilm_generation_tokens_total": "generated tokens",
        "infinilm_prompt_tokens_total": "prompt tokens",
        "infinilm_kv_cache_hit_rate": "prefix-cache hit rate",
        "infinilm_kv_cache_usage_ratio": "KV usage",
        "infinilm_dlq_records_total": "DLQ records",
    }
    table = Table(title="metrics summary (from this worker's /metrics)")
    table.add_column("metric")
    table.add_column("labels")
    table.add_column("value")
    for family in registry.collect():
        for sample in family.samples:
            if sample.name in wanted and sample.value:
                labels = ",".join(f"{k}={v}" for k, v in sample.labels.items())
                table.add_row(wanted[sample.name], labels, f"{sample.value:g}")
    console.print(table)

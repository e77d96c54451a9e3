"""A "traditional framework" worker, the seed's baseline for bench.slo: a plain aiokafka consumer that runs
HF transformers `generate` on static, left-padded batches of whatever requests have arrived (up to 16).

No continuous batching, no streaming, at-least-once: it produces each batch's results, then commits the
batch's offsets. It reads the chat requests bench.slo sends (msgpack) and answers each with a msgpack
result that has `id`, `status`, `text` and `usage`, which is all bench.slo reads.

    python -m bench.hf_worker --bootstrap 127.0.0.1:9092 --requests T --results R --group G --model PATH
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from pathlib import Path

import msgpack
import torch


def load(path: Path):
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation="sdpa").eval()
    return tok, model


@torch.inference_mode()
def generate_batch(tok, model, requests: list[dict]) -> list[dict]:
    """One static batch: every row runs to the longest `max_tokens`, then is cut to its own."""
    texts = [tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False) for r in requests]
    prompts = [tok(text, add_special_tokens=False)["input_ids"] for text in texts]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    longest = max(r.get("max_tokens", 64) for r in requests)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=longest,
                         pad_token_id=pad)[:, width:]
    results = []
    for row, r in enumerate(requests):
        new = out[row, :r.get("max_tokens", 64)].tolist()
        if tok.eos_token_id in new:
            new = new[:new.index(tok.eos_token_id)]
        results.append({"id": r["id"], "kind": "chat", "status": "ok", "text": tok.decode(new),
                        "usage": {"prompt_tokens": len(prompts[row]), "completion_tokens": len(new)}})
    return results


async def serve(args) -> None:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    tok, model = load(Path(args.model))
    generate_batch(tok, model, [{"id": "warm-up", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}])
    consumer = AIOKafkaConsumer(args.requests, bootstrap_servers=args.bootstrap, group_id=args.group,
                                enable_auto_commit=False, auto_offset_reset="earliest",
                                max_poll_interval_ms=600_000)
    producer = AIOKafkaProducer(bootstrap_servers=args.bootstrap, acks="all")
    await consumer.start()
    await producer.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    try:
        while not stop.is_set():
            batch = await consumer.getmany(timeout_ms=50, max_records=args.max_batch)
            records = [rec for recs in batch.values() for rec in recs]
            if not records:
                continue
            requests = [msgpack.unpackb(rec.value, raw=False) for rec in records]
            # The engine call blocks; a thread keeps the consumer's heartbeats going meanwhile.
            results = await asyncio.to_thread(generate_batch, tok, model, requests)
            for res in results:
                await producer.send_and_wait(args.results, msgpack.packb(res), key=res["id"].encode())
            await consumer.commit()
    finally:
        with contextlib.suppress(Exception):
            await consumer.stop()
        await producer.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--requests", required=True, help="the chat requests topic")
    ap.add_argument("--results", required=True, help="the topic results go to")
    ap.add_argument("--group", required=True, help="consumer group id")
    ap.add_argument("--model", required=True, help="an HF model folder")
    ap.add_argument("--max-batch", type=int, default=16, help="the most requests one static batch takes")
    asyncio.run(serve(ap.parse_args()))


if __name__ == "__main__":
    main()

"""`infinilm generate`: one-off offline generation, streamed to the terminal."""

from __future__ import annotations

import json
import sys
import time

import typer


def register(app: typer.Typer) -> None:
    @app.command(help="Generate text offline with the engine (no Kafka, no Redis).")
    def generate(
        prompt: str = typer.Option(..., "--prompt", "-p", help="The prompt text (with --chat: the user message)."),
        model: str = typer.Option("smollm2", help="Model alias (smollm2) or a Hugging Face model folder."),
        chat: bool = typer.Option(False, "--chat", help="Wrap the prompt as a user message in the chat template."),
        system: str | None = typer.Option(None, help="A system message (with --chat)."),
        max_tokens: int = typer.Option(128, "--max-tokens", help="Most tokens to generate."),
        temperature: float = typer.Option(0.0, help="0 is greedy; higher is more random."),
        top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass in (0, 1]."),
        top_k: int = typer.Option(0, "--top-k", help="Keep the k most likely tokens (0: off)."),
        seed: int | None = typer.Option(None, help="Seed for reproducible sampling."),
        stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
        dtype: str = typer.Option("auto", help="float32, bfloat16, float16 or auto (fp32 on CPU)."),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    ) -> None:
        from engine import EngineConfig, EngineCore, RequestError, SamplingParams
        from engine.errors import ModelLoadError
        from engine.model_registry import ModelNotFoundError

        try:
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                    seed=seed, stop=stop)
            engine = EngineCore(EngineConfig(model=model, dtype=dtype))
            if chat:
                messages = ([{"role": "system", "content": system}] if system else []) + [
                    {"role": "user", "content": prompt}]
                text = engine.tokenizer.apply_chat_template(messages)
                engine.add_request("cli", engine.tokenizer.encode(text, add_special_tokens=False), params)
            else:
                engine.add_request("cli", prompt, params)
        except RequestError as exc:
            typer.echo(f"error ({exc.code}): {exc}", err=True)
            raise typer.Exit(2) from exc
        except (ModelNotFoundError, ModelLoadError, ValueError) as exc:  # GGUFImportError is a ValueError
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from exc
        start = time.perf_counter()
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if not as_json and out.new_text:
                    sys.stdout.write(out.new_text)
                    sys.stdout.flush()
                if out.finished:
                    final = out
        elapsed = time.perf_counter() - start
        if as_json:
            typer.echo(json.dumps({
                "text": final.text, "finish_reason": final.finish_reason, "token_ids": final.token_ids,
                "prompt_tokens": len(final.prompt_token_ids), "completion_tokens": len(final.token_ids),
                "seconds": round(elapsed, 3),
            }, ensure_ascii=False))
        else:
            typer.echo("")
            typer.echo(f"[{len(final.token_ids)} tokens in {elapsed:.2f}s, finish_reason={final.finish_reason}]",
                       err=True)

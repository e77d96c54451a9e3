"""Chat completions: chat template in, generated text out."""

from __future__ import annotations

from engine import RequestError, RequestOutput, SamplingParams
from schemas import ChatRequest, Result, Usage
from worker.handlers import HandlerContext, Prepared, Work


def sampling_params_for(req: ChatRequest, *, ignore_eos: bool = False) -> SamplingParams:
    return SamplingParams(
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=max(req.top_k, 0),
        min_p=req.min_p,
        seed=req.seed,
        stop=req.stop_list,
        ignore_eos=ignore_eos,
    )


def encode_chat(messages: list[dict[str, str]], ctx: HandlerContext) -> list[int]:
    text = ctx.tokenizer.apply_chat_template(messages)
    return ctx.tokenizer.encode(text, add_special_tokens=False)


def check_length(token_ids: list[int], max_tokens: int, ctx: HandlerContext) -> None:
    if len(token_ids) >= ctx.max_model_len:
        raise RequestError(
            f"the prompt has {len(token_ids)} tokens; max_seq_len is {ctx.max_model_len}",
            code="prompt_too_long",
        )


class ChatHandler:
    kind = "chat"

    async def prepare(self, req: ChatRequest, ctx: HandlerContext) -> Prepared:
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        token_ids = encode_chat(messages, ctx)
        check_length(token_ids, req.max_tokens, ctx)
        return Prepared(work=[Work(token_ids, sampling_params_for(req), stream=req.stream)])

    async def finish(self, req: ChatRequest, prepared: Prepared, outputs: list[RequestOutput],
                     ctx: HandlerContext) -> Result:
        (out,) = outputs
        return Result(
            id=req.id, kind="chat", text=out.text, finish_reason=out.finish_reason,
            usage=Usage(prompt_tokens=len(out.prompt_token_ids), completion_tokens=len(out.token_ids),
                        cached_tokens=out.num_cached_tokens),
        )

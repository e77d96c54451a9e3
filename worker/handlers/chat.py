"""Chat completions: chat template in, generated text out, with rules and a compliance check.

Rules come from the request (`rules`), the tenant (`chat.tenant_rules`), the
topic (`chat.topic_rules`) and `chat.forbidden_phrases`. They go into the
prompt as constraint lines (`##必须遵守: ...`, through `chat.rules_template`),
forbidden phrases are blocked at the logits, and the output is checked. With
`chat.repair_policy: regenerate` a violating answer is generated once more
with a stricter prompt; the result reports `compliance` either way.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine import RequestError, RequestOutput, SamplingParams
from schemas import (
    DEFAULT_MAX_TOKENS,
    ChatRequest,
    Compliance,
    Result,
    TokenLogprob,
    TopLogprob,
    Violation,
)
from worker.handlers import HandlerContext, Prepared, Work, usage_of
from worker.handlers.images import image_parts, template_messages
from worker.rules import STRICT_LINE, RuleError, RuleSet


def sampling_params_for(req: ChatRequest, *, banned: tuple[str, ...] = (), deterministic: bool = False,
                        speculative: bool = False, default_max_tokens: int = DEFAULT_MAX_TOKENS) -> SamplingParams:
    return SamplingParams(
        max_tokens=req.max_tokens if req.max_tokens is not None else default_max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=max(req.top_k, 0),
        min_p=req.min_p,
        seed=req.seed,
        stop=req.stop_list,
        logprobs=req.top_logprobs if req.logprobs else None,
        banned_phrases=banned,
        deterministic=deterministic,
        speculative=speculative,
    )


def token_logprobs(out: RequestOutput, tokenizer) -> list[TokenLogprob]:
    """The result's `logprobs`: each generated token with its log-probability and the top alternatives."""
    texts: dict[int, str] = {}

    def text(token_id: int) -> str:
        if token_id not in texts:
            texts[token_id] = tokenizer.decode([token_id], skip_special_tokens=False)
        return texts[token_id]

    # One engine entry a step, one token a step: such requests never speculate (engine.speculative).
    return [TokenLogprob(token_id=tid, token=text(tid), logprob=chosen,
                         top=[TopLogprob(token_id=alt, token=text(alt), logprob=lp) for alt, lp in top])
            for tid, (chosen, top) in zip(out.token_ids, out.logprobs or [], strict=False)]


def encode_chat(messages: list[dict[str, str]], ctx: HandlerContext) -> list[int]:
    text = ctx.tokenizer.apply_chat_template(messages)
    return ctx.tokenizer.encode(text, add_special_tokens=False)


def check_length(token_ids: list[int], ctx: HandlerContext, image_positions: int = 0) -> None:
    """`image_positions`: how many positions the image placeholders add when they expand."""
    if len(token_ids) + image_positions >= ctx.max_model_len:
        raise RequestError(
            f"the prompt has {len(token_ids) + image_positions} tokens; max_seq_len is {ctx.max_model_len}",
            code="prompt_too_long",
        )


@dataclass
class ChatState:
    rules: RuleSet
    context: str
    attempt: int = 0
    first_violations: tuple[str, ...] = ()
    images: tuple = ()  # engine ImageInputs, in prompt order; a repair attempt reuses them


class ChatHandler:
    kind = "chat"

    def _rules(self, req: ChatRequest, ctx: HandlerContext) -> RuleSet:
        cc = ctx.config.chat
        lines = [*req.rules, *cc.tenant_rules.get(req.tenant or "", ()), *cc.topic_rules.get(ctx.config.topics.chat, ()),
                 *(f"forbid: {p}" for p in cc.forbidden_phrases)]
        try:
            return RuleSet(lines, cc.rules_template)
        except RuleError as exc:
            raise RequestError(str(exc), code="invalid_request") from exc

    def _work(self, req: ChatRequest, ctx: HandlerContext, state: ChatState, extra: tuple[str, ...] = ()) -> Work:
        messages = template_messages(req, ctx.images.placeholder if ctx.images else None)
        if state.rules:
            block = state.rules.prompt_block(extra)
            if messages[0]["role"] == "system":
                messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n{block}"}
            else:
                messages.insert(0, {"role": "system", "content": block})
        token_ids = encode_chat(messages, ctx)
        extra = len(state.images) * (ctx.images.positions_per_image - 1) if state.images else 0
        check_length(token_ids, ctx, extra)
        deterministic = req.deterministic if req.deterministic is not None else ctx.config.execution.deterministic
        params = sampling_params_for(req, banned=state.rules.banned_phrases, deterministic=deterministic,
                                     speculative=ctx.config.speculative.chat,
                                     default_max_tokens=ctx.config.chat.default_max_tokens)
        # A repair attempt streams too, after a `restart` delta that voids the first attempt's text.
        return Work(token_ids, params, stream=req.stream, images=state.images,
                    image_positions=extra)

    async def prepare(self, req: ChatRequest, ctx: HandlerContext) -> Prepared:
        images = await ctx.images.read(req) if ctx.images else tuple(image_parts(req, None))
        state = ChatState(self._rules(req, ctx), "\n".join(m.text for m in req.messages), images=images)
        return Prepared(work=[self._work(req, ctx, state)], state=state)

    async def finish(self, req: ChatRequest, prepared: Prepared, outputs: list[RequestOutput],
                     ctx: HandlerContext) -> Result | Prepared:
        (out,) = outputs
        state: ChatState = prepared.state
        compliance = None
        if state.rules:
            violations = state.rules.check(out.text, state.context)
            if ctx.metrics is not None:
                for v in violations:
                    ctx.metrics.inc_rule_violation(v.rule)
            if violations and state.attempt == 0 and ctx.config.chat.repair_policy == "regenerate":
                broken = "; ".join(sorted({v.rule for v in violations}))
                retry = ChatState(state.rules, state.context, attempt=1, first_violations=tuple(v.rule for v in violations),
                                  images=state.images)
                return Prepared(work=[self._work(req, ctx, retry, (STRICT_LINE.format(broken=broken),))], state=retry)
            compliance = Compliance(passed=not violations,
                                    violations=[Violation(rule=v.rule, detail=v.detail) for v in violations])
        return Result(
            id=req.id, kind="chat", text=out.text, finish_reason=out.finish_reason, compliance=compliance,
            usage=usage_of([out]),
            logprobs=token_logprobs(out, ctx.tokenizer) if req.logprobs else None,
        )

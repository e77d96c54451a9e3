"""The rule engine: parsing, prompt lines, output checks; banned phrases with real SmolLM2 generations."""

from __future__ import annotations

import asyncio

import pytest

from engine import LLM, SamplingParams
from schemas import ChatRequest, Message
from worker.config import load_config
from worker.config_sections import DEFAULT_RULES_TEMPLATE
from worker.handlers import HandlerContext, Prepared
from worker.handlers.chat import ChatHandler
from worker.metrics import WorkerMetrics
from worker.rules import RuleError, RuleSet, parse_rule

# Slow tier (loads SmolLM2): `ops/dev.sh test --fast` leaves it out.
pytestmark = pytest.mark.slow


def test_rules_parse_into_kinds_and_prompt_lines():
    rs = RuleSet(["forbid: guaranteed returns", "forbid_regex: \\bSSN\\b", "format: json",
                  "numbers_from_context", "Be polite.", "Be polite."], DEFAULT_RULES_TEMPLATE)
    assert [r.kind for r in rs.rules] == ["forbid", "forbid_regex", "format_json", "numbers_from_context", "instruction"]
    block = rs.prompt_block()
    assert block.splitlines() == [
        '##必须遵守: Never write "guaranteed returns".',
        "##必须遵守: Never write text matching the pattern \\bSSN\\b.",
        "##必须遵守: Answer with valid JSON only, and nothing else.",
        "##必须遵守: Only use numbers that appear in the conversation; never invent or change a number.",
        "##必须遵守: Be polite.",
    ]
    assert rs.banned_phrases == ("guaranteed returns",)
    with pytest.raises(RuleError):
        parse_rule("forbid_regex: (unclosed")
    with pytest.raises(RuleError):
        parse_rule("format: yaml")


@pytest.mark.timeout(60)  # a backtracking engine runs this check for longer than the universe has existed
def test_a_request_pattern_cannot_stall_the_worker():
    rs = RuleSet(["forbid_regex: (\\D*)*\\d"], DEFAULT_RULES_TEMPLATE)
    assert rs.check("Say hello and ask how you can help. " * 200, "") == []
    assert [v.rule for v in rs.check("a" * 5000 + "7", "")] == ["forbid_regex"]


@pytest.mark.parametrize("pattern", ["(a)\\1", "(?=x)a", "(?<!x)a"])
def test_patterns_re2_cannot_run_in_linear_time_are_refused_by_name(pattern, capfd):
    with pytest.raises(RuleError, match=r"not a regular expression RE2 takes .*no backreferences or lookaround"):
        parse_rule(f"forbid_regex: {pattern}")
    assert capfd.readouterr().err == ""  # RE2's own log line stays off the worker's stderr


def test_checks_find_each_kind_of_violation():
    rs = RuleSet(["forbid: guaranteed returns", "forbid_regex: \\d{3}-\\d{2}-\\d{4}", "format: json",
                  "numbers_from_context"], DEFAULT_RULES_TEMPLATE)
    context = "Order 1,204 costs $35.50 and ships on 2024-05-01."
    assert {v.rule for v in rs.check('{"total": 35.50, "order": 1204}', context)} == set()
    found = {v.rule: v.detail for v in rs.check("Guaranteed Returns! SSN 123-45-6789, total 99", context)}
    assert set(found) == {"forbid", "forbid_regex", "format_json", "numbers_from_context"}
    assert "99" in found["numbers_from_context"]


@pytest.fixture(scope="module")
def smol():
    return LLM(model="smollm2", dtype="float32")


def chat_prompt(llm, question: str) -> list[int]:
    tok = llm.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]), add_special_tokens=False)


def test_banned_phrase_is_blocked_at_the_logits(smol):
    prompt = chat_prompt(smol, "What is the capital of France?")
    free = smol.generate([prompt], SamplingParams(max_tokens=24, temperature=0))[0]
    assert "Paris" in free.text  # the model's own answer uses the phrase
    banned = smol.generate([prompt], SamplingParams(max_tokens=24, temperature=0, banned_phrases=("Paris",)))[0]
    assert "paris" not in banned.text.lower()
    assert banned.text != free.text


def handler_ctx(smol, **chat_overrides) -> HandlerContext:
    import msgspec

    cfg = load_config(None)
    cfg = msgspec.structs.replace(cfg, chat=msgspec.structs.replace(cfg.chat, **chat_overrides))
    return HandlerContext(tokenizer=smol.tokenizer, max_model_len=smol.engine.max_model_len,
                          max_num_batched_tokens=2048, worker_id="t", model_name="smollm2", config=cfg,
                          metrics=WorkerMetrics())


def run_chat(smol, req: ChatRequest, ctx: HandlerContext):
    """Drive the chat handler through prepare -> engine -> finish (and its repair round)."""
    handler = ChatHandler()
    prepared: Prepared = asyncio.run(handler.prepare(req, ctx))
    rounds = 0
    while True:
        rounds += 1
        (work,) = prepared.work
        out = smol.generate([work.prompt_token_ids], work.params)[0]
        result = asyncio.run(handler.finish(req, prepared, [out], ctx))
        if not isinstance(result, Prepared):
            return result, rounds
        prepared = result


def test_violations_are_reported_after_one_stricter_regeneration(smol):
    ctx = handler_ctx(smol)
    req = ChatRequest(id="r", messages=[Message(role="user", content="What is 12 times 12?")], max_tokens=32,
                      temperature=0.0, rules=["forbid_regex: \\d"])
    result, rounds = run_chat(smol, req, ctx)
    assert rounds == 2  # the first answer had digits, so it was regenerated once
    assert result.compliance is not None
    if result.compliance.passed:
        assert not any(ch.isdigit() for ch in result.text)
    else:
        assert [v.rule for v in result.compliance.violations] == ["forbid_regex"]
    sample = ctx.metrics.registry.get_sample_value("infinilm_rule_violations_total", {"rule": "forbid_regex"})
    assert sample >= 1


def test_flag_policy_reports_without_regenerating_and_rules_reach_the_prompt(smol):
    ctx = handler_ctx(smol, repair_policy="flag")
    req = ChatRequest(id="r", messages=[Message(role="user", content="What is 12 times 12?")], max_tokens=32,
                      temperature=0.0, rules=["forbid_regex: \\d", "Answer in one short sentence."])
    prepared = asyncio.run(ChatHandler().prepare(req, ctx))
    prompt_text = smol.tokenizer.decode(prepared.work[0].prompt_token_ids, skip_special_tokens=False)
    assert "##必须遵守: Answer in one short sentence." in prompt_text
    result, rounds = run_chat(smol, req, ctx)
    assert rounds == 1
    assert result.compliance.passed == (not any(ch.isdigit() for ch in result.text))


def test_compliant_answers_pass(smol):
    ctx = handler_ctx(smol)
    req = ChatRequest(id="r", messages=[Message(role="user", content="Say hello.")], max_tokens=16,
                      temperature=0.0, rules=["forbid: goodbye"])
    result, _ = run_chat(smol, req, ctx)
    assert result.compliance.passed and result.compliance.violations == []


def test_chat_logprobs_list_each_generated_token_with_its_alternatives(smol):
    ctx = handler_ctx(smol)
    req = ChatRequest(id="lp", messages=[Message(role="user", content="Say hi.")], max_tokens=48, temperature=0.0,
                      logprobs=True, top_logprobs=3)
    result, _ = run_chat(smol, req, ctx)
    entries = result.logprobs
    assert entries and len(entries) == result.usage.completion_tokens
    for entry in entries:
        assert entry.logprob <= 0.0 and len(entry.top) == 3
        assert [t.logprob for t in entry.top] == sorted((t.logprob for t in entry.top), reverse=True)
        # Greedy: the chosen token is the most likely one, with the same log-probability.
        assert (entry.top[0].token_id, entry.top[0].logprob) == (entry.token_id, entry.logprob)
        assert entry.token == smol.tokenizer.decode([entry.token_id], skip_special_tokens=False)
    ids = [e.token_id for e in entries]
    assert smol.tokenizer.decode(ids) == result.text  # the entries are the answer's tokens, in order
    # Without the flag there are none; with a repair round they describe the answer that was kept.
    assert run_chat(smol, msgspec_replace(req, logprobs=False, top_logprobs=0), ctx)[0].logprobs is None
    repaired, rounds = run_chat(smol, msgspec_replace(req, rules=["forbid_regex: \\S"]), ctx)
    assert rounds == 2 and len(repaired.logprobs) == repaired.usage.completion_tokens
    assert smol.tokenizer.decode([e.token_id for e in repaired.logprobs]) == repaired.text


def msgspec_replace(req, **changes):
    import msgspec

    return msgspec.structs.replace(req, **changes)

"""The offline API on a tiny random model: outputs, errors, stops, seeds, streaming text."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, BlockStored, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(model=str(tiny_llama), dtype="float32", max_model_len=128, num_kv_blocks=64, block_size=8)


GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def test_outputs_come_back_in_order_with_text(llm):
    outs = llm.generate(["hello world", "a", "the quick brown fox"], GREEDY)
    assert [o.prompt for o in outs] == ["hello world", "a", "the quick brown fox"]
    for o in outs:
        assert o.error is None and o.finish_reason == "length" and len(o.token_ids) == 12
        assert o.text == llm.tokenizer.decode(o.token_ids)


def test_token_id_prompts_work_like_text(llm):
    ids = llm.tokenizer.encode("hello world")
    a, b = llm.generate([ids, "hello world"], GREEDY)
    assert a.token_ids == b.token_ids


def test_bad_requests_fail_alone(llm):
    too_long = list(range(3, 3 + 200))
    outs = llm.generate([too_long, [5, 6, 7], [999999], [], "fine"],
                        [GREEDY, SamplingParams(max_tokens=3, temperature=0), GREEDY, GREEDY, GREEDY])
    assert outs[0].error.code == "prompt_too_long" and outs[0].finish_reason == "error"
    assert outs[1].error is None and len(outs[1].token_ids) == 3
    assert outs[2].error.code == "invalid_request"
    assert outs[3].error.code == "invalid_request"
    assert outs[4].error is None and len(outs[4].token_ids) == 12


def test_stop_string_cuts_the_text_and_streaming_never_leaks_it(llm):
    free = llm.generate(["stop test"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    stop = free.text[8:11]
    assert len(stop) == 3
    engine = llm.engine
    engine.add_request("s", "stop test", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]))
    pieces, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces.append(out.new_text)
            final = out
    assert final.finish_reason == "stop"
    assert final.text == free.text[: free.text.index(stop)]
    assert "".join(pieces) == final.text


def test_stop_token_ids_end_generation(llm):
    free = llm.generate(["tokens"], GREEDY)[0]
    stop_id = free.token_ids[4]
    first = free.token_ids.index(stop_id)
    out = llm.generate(["tokens"], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_id]))[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: first + 1]


def test_streamed_text_adds_up_to_the_final_text(llm):
    engine = llm.engine
    engine.add_request("stream", "stream me", SamplingParams(max_tokens=20, temperature=0.8, seed=3))
    pieces, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces.append(out.new_text)
            final = out
    assert "".join(pieces) == final.text


def test_every_step_reports_the_prompt_ids_without_copying_them(llm):
    engine = llm.engine
    prompt = llm.tokenizer.encode("the prompt ids of a streamed request")
    engine.add_request("prompt-ids", list(prompt), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == "prompt-ids"]
    assert len(outs) >= 6 and outs[-1].finished and len(outs[-1].token_ids) == 6
    assert all(o.prompt_token_ids == prompt for o in outs)
    # One list for the whole request (not a slice per step), and not the engine's working list,
    # which grew by the six outputs meanwhile.
    assert len({id(o.prompt_token_ids) for o in outs}) == 1


def test_same_seed_same_tokens_alone_and_in_a_batch(llm):
    seeded = SamplingParams(max_tokens=10, temperature=1.0, seed=42)
    alone = llm.generate(["seeded"], seeded)[0]
    mixed = llm.generate(["other one", "seeded", "x"],
                         [SamplingParams(max_tokens=5, temperature=1.0), seeded, GREEDY])[1]
    assert alone.token_ids == mixed.token_ids
    different = llm.generate(["seeded"], SamplingParams(max_tokens=10, temperature=1.0, seed=43))[0]
    assert different.token_ids != alone.token_ids


def test_chat_applies_the_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], GREEDY)[0]
    expected = llm.tokenizer.encode("<s>user: hi</s><s>assistant: ", add_special_tokens=False)
    assert out.prompt_token_ids == expected


def test_chat_content_that_is_not_text_fails_its_conversation_alone(llm):
    outs = llm.chat([[{"role": "user", "content": "hi"}], [{"role": "user", "content": None}],
                     [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]], GREEDY)
    assert outs[0].error is None and len(outs[0].token_ids) == 12
    assert outs[1].error.code == "invalid_request" and "message 0: 'content' must be a string, got NoneType" in str(
        outs[1].error)
    assert outs[2].error.code == "invalid_request" and "got list" in str(outs[2].error)


@pytest.mark.parametrize(("call", "message"), [
    (lambda llm: llm.chat("hello"), "chat takes a conversation"),
    (lambda llm: llm.chat({"role": "user", "content": "hi"}), "chat takes a conversation"),
    (lambda llm: llm.generate(None), "prompts must be a string"),
    (lambda llm: llm.generate(5), "prompts must be a string"),
    (lambda llm: llm.generate(["a"], {"max_tokens": 3}), "params must be a SamplingParams or a list of them"),
    (lambda llm: llm.generate(["a", "b"], masks=[None]), "got 1 masks for 2 prompts"),
])
def test_arguments_of_the_wrong_shape_are_a_clear_error(llm, call, message):
    with pytest.raises((TypeError, ValueError), match=message):
        call(llm)
    assert not llm.engine.has_unfinished_requests()


def test_numpy_and_torch_integer_ids_and_tuples_are_prompts(llm):
    import numpy as np
    import torch

    ids = llm.tokenizer.encode("hello world")
    plain = llm.generate([ids], GREEDY)[0]
    for prompt in (tuple(ids), [np.int64(t) for t in ids], [torch.tensor(t) for t in ids]):
        (out,) = llm.generate(prompt, GREEDY)
        assert out.error is None and out.token_ids == plain.token_ids
    (array,) = llm.generate([np.array(ids)], GREEDY)
    assert array.error.code == "invalid_request" and "got ndarray (pass .tolist())" in str(array.error)
    (floats,) = llm.generate([[1.0, 2.0]], GREEDY)
    assert floats.error.code == "invalid_request"


def test_a_call_that_ends_early_leaves_nothing_for_the_next(llm, monkeypatch):
    """An interrupted call (Ctrl-C, an exception out of a step) aborts its requests: the next call gets its
    own outputs, not the first call's."""
    engine = llm.engine
    real_step, steps = engine.step, []

    def interrupted_step():
        steps.append(1)
        if len(steps) == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["a long story about a dragon"], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    monkeypatch.setattr(engine, "step", real_step)
    (out,) = llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert out.prompt == "hello" and len(out.token_ids) == 4
    assert not engine.has_unfinished_requests() and engine.block_manager.usage == 0.0


def test_prefix_cache_reports_cached_tokens_and_kv_events(llm):
    prompt = "a shared system prompt that is long enough to fill several blocks"
    llm.engine.take_kv_events()
    first = llm.generate([prompt], GREEDY)[0]
    events = llm.engine.take_kv_events()
    assert any(isinstance(e, BlockStored) for e in events)
    second = llm.generate([prompt], GREEDY)[0]
    assert first.error is None
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= len(first.prompt_token_ids) - 8
    assert second.token_ids == first.token_ids


def test_abort_finishes_the_request(llm):
    engine = llm.engine
    engine.add_request("to-abort", "abort me", SamplingParams(max_tokens=50, temperature=0))
    engine.step()
    assert engine.abort_request("to-abort")
    outs = engine.step()
    assert [o.finish_reason for o in outs if o.request_id == "to-abort"] == ["abort"]
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.usage == 0.0


def test_duplicate_request_id_is_refused(llm):
    from engine.errors import InvalidRequestError

    engine = llm.engine
    engine.add_request("dup", "x", GREEDY)
    with pytest.raises(InvalidRequestError):
        engine.add_request("dup", "y", GREEDY)
    engine.abort_request("dup")
    engine.step()


def test_unknown_engine_option_is_a_clear_error(tiny_llama):
    from engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="unknown engine option"):
        LLM(model=str(tiny_llama), max_num_seq=3)


def test_dummy_load_format_needs_only_config_json(tmp_path, tiny_llama):
    (tmp_path / "config.json").write_text((tiny_llama / "config.json").read_text())
    llm = LLM(model=str(tmp_path), dtype="float32", load_format="dummy", num_kv_blocks=16)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert out.error is None and len(out.token_ids) == 4
    # Without a tokenizer a stop string could never match: refused, where it was ignored.
    (stopped,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, stop=["x"]))
    assert stopped.error.code == "invalid_request" and "stop strings need a model with a tokenizer" in str(
        stopped.error)


def test_a_bad_attention_backend_or_a_missing_gpu_is_refused_before_the_model_loads(tiny_llama):
    from engine.errors import InvalidRequestError, ModelLoadError

    with pytest.raises(InvalidRequestError, match="attention_backend must be 'auto', 'torch', 'cpu_paged'"):
        LLM(model=str(tiny_llama), attention_backend="bogus")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="device 'cuda:0': this host has 0 CUDA device"):
            LLM(model=str(tiny_llama), device="cuda:0")


def test_building_and_running_a_model_imports_neither_dynamo_nor_triton(tiny_llama):
    # The model is built on the meta device; torch computes some meta ops with Python decompositions
    # that import torch._dynamo and, through it, Triton, whose bindings then print hundreds of
    # "nanobind: leaked ..." lines when the CLI or demo exits. Run in a fresh interpreter.
    import subprocess
    import sys

    code = ("import sys\nfrom engine import LLM, SamplingParams\n"
            f"llm = LLM(model={str(tiny_llama)!r}, dtype='float32')\n"
            "out = llm.generate(['hello'], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))\n"
            "assert len(out[0].token_ids) == 3\n"
            "print(sorted(m for m in ('torch._dynamo', 'triton') if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"
    assert "nanobind" not in result.stderr

"""Incremental detokenization and stop strings, per request."""

from __future__ import annotations

import time

from engine.outputs import RequestMetrics, RequestOutput
from engine.request import Request
from engine.tokenizer import Tokenizer


class _TextState:
    __slots__ = ("emitted", "logprobs", "max_stop_len", "prompt_logprobs", "stream", "text")

    def __init__(self, request: Request, tokenizer: Tokenizer | None) -> None:
        self.stream = tokenizer.decode_stream(request.params.skip_special_tokens) if tokenizer else None
        self.text = ""
        self.emitted = 0  # chars of text already handed out as new_text
        self.max_stop_len = max((len(s) for s in request.params.stop), default=0)
        self.logprobs: list | None = [] if request.params.logprobs is not None else None
        self.prompt_logprobs: dict[int, float] | None = {} if request.params.score_positions else None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _TextState] = {}

    def add(self, request: Request) -> None:
        self._states[request.request_id] = _TextState(request, self.tokenizer)

    def add_prompt_logprobs(self, request_id: str, scores: dict[int, float]) -> None:
        st = self._states.get(request_id)
        if st is not None and st.prompt_logprobs is not None:
            st.prompt_logprobs.update(scores)

    def process_run(self, request: Request, token_ids: list[int], logprob,
                    finished: bool) -> tuple[RequestOutput, bool, int]:
        """Fold a step's new tokens (several after a verified speculative run) into one output.

        Returns the output, whether a stop string ended the request, and how many of the tokens
        it used: a stop string ends the run at the token that completes it, and the output leaves
        the rest out (the caller drops them from the request).
        """
        st = self._states[request.request_id]
        now = time.monotonic()
        if request.first_token_time is None:
            request.first_token_time = now
        if st.logprobs is not None and logprob is not None:
            st.logprobs.append(logprob)
        stop_hit = False
        used = 0
        for token_id in token_ids:
            used += 1
            if st.stream is not None and token_id not in request.stop_token_ids:
                piece = self.tokenizer.step_stream(st.stream, token_id)
                if piece:
                    before = len(st.text)
                    st.text += piece
                    if st.max_stop_len and self._check_stop(request, st, before):
                        stop_hit = True
                        break
        unused = len(token_ids) - used
        done = finished or stop_hit
        if finished and not stop_hit and st.stream is not None:
            # The stream holds back bytes of an unfinished UTF-8 character; at the
            # end they are flushed as a full decode would show them.
            full = self.tokenizer.decode(request.output_token_ids, request.params.skip_special_tokens)
            if full.startswith(st.text):
                st.text = full
        # While a stop string may still be forming, hold back its possible prefix.
        holdback = 0 if done else max(st.max_stop_len - 1, 0)
        visible = max(len(st.text) - holdback, st.emitted)
        new_text = st.text[st.emitted:visible]
        st.emitted = visible
        out = self._output(request, token_ids[:used], new_text, done, "stop" if stop_hit else request.finish_reason,
                           now, unused=unused)
        if done:
            self._states.pop(request.request_id, None)
        return out, stop_hit, used

    def _check_stop(self, request: Request, st: _TextState, before: int) -> bool:
        window_start = max(0, before - st.max_stop_len + 1)
        for stop in request.params.stop:
            idx = st.text.find(stop, window_start)
            if idx != -1:
                end = idx + len(stop) if request.params.include_stop_str_in_output else idx
                st.text = st.text[:end]
                st.emitted = min(st.emitted, end)
                return True
        return False

    def finish_without_token(self, request: Request, reason: str, error=None) -> RequestOutput:
        st = self._states.pop(request.request_id, None)
        text = st.text if st else ""
        new_text = text[st.emitted:] if st else ""
        out = self._output(request, [], new_text, True, reason, time.monotonic(), text=text,
                           logprobs=st.logprobs if st else None)
        out.error = error
        return out

    def _output(self, request: Request, new_ids, new_text, finished, reason, now, text=None, logprobs=None,
                unused: int = 0):
        st = self._states.get(request.request_id)
        token_ids = request.output_token_ids
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=token_ids[:len(token_ids) - unused],
            text=text if text is not None else (st.text if st else ""),
            new_token_ids=new_ids,
            new_text=new_text,
            finished=finished,
            finish_reason=reason if finished else None,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            logprobs=logprobs if logprobs is not None else (st.logprobs if st else None),
            metrics=RequestMetrics(request.arrival_time, request.first_scheduled_time,
                                   request.first_token_time, now if finished else None),
            num_preemptions=request.num_preemptions,
            prompt_logprobs=st.prompt_logprobs if st else None,
        )

"""Output processing: the text of every request.

The scheduler owns token ids, counters and status; this owns what they read as: a detokenizer, the
stop-string check and the output text per request. Each step, `process()` turns the step's new tokens
into RequestOutputs (the text delta of each token) and reports the requests that ended on a stop
string; the engine tells the scheduler, whose `finish` is still the only thing that ends a request and
frees its blocks.

Stop strings are checked in one place, `StopStrings`: text that could still be the start of a stop
string is held back until it is known not to be one (and then emitted with a later token), so neither
the streamed deltas nor the final text ever contain a stop string or the part of one that arrived
before the rest (unless `include_stop_str_in_output`, as vLLM has it). A request's later tokens in
the same step carry no text; held-back text is released when the request ends any other way (a stop
token, its length).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kvcli.engine.detokenizer import IncrementalDetokenizer
from kvcli.engine.outputs import RequestOutput
from kvcli.engine.request import Request
from kvcli.model.tokenizer import Tokenizer
from kvcli.step import TokenLogprob


class StopStrings:
    """The stop-string check over a text that arrives in pieces, pure (no tokens, no model).

    `push(piece)` returns the text now safe to emit and whether a stop string completed. The text
    ends at the first stop string to complete (the one ending earliest; of those ending at the same
    place, the longest), whatever the pieces were, so the result does not depend on how a tokenizer
    split the text. `flush()` releases what is held back once no more text will come.
    """

    __slots__ = ("stops", "include", "held", "stopped", "_longest")

    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self.stops = tuple(stops)
        self.include = include_stop_str_in_output
        self.held = ""  # received, not emitted: it may be the start of a stop string
        self.stopped = False
        self._longest = max((len(s) for s in self.stops), default=0)

    def push(self, piece: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return piece, False
        buf = self.held + piece
        # A match cannot start in text already emitted: that text was emitted because no stop string
        # could start there given what followed it, and more text does not change that.
        best_end = best_start = -1
        for s in self.stops:
            i = buf.find(s)
            if i >= 0:
                end = i + len(s)
                if best_end < 0 or end < best_end or (end == best_end and i < best_start):
                    best_end, best_start = end, i
        if best_end >= 0:
            self.stopped = True
            self.held = ""
            return buf[:best_end if self.include else best_start], True
        # Hold the longest tail that a stop string starts with (a proper prefix of one).
        hold = len(buf)
        for h in range(max(0, len(buf) - self._longest + 1), len(buf)):
            tail = buf[h:]
            if any(s.startswith(tail) for s in self.stops):
                hold = h
                break
        self.held = buf[hold:]
        return buf[:hold], False

    def flush(self) -> str:
        """The held-back text, for a request that ended otherwise than on a stop string."""
        out, self.held = ("" if self.stopped else self.held), ""
        return out


class _RequestText:
    __slots__ = ("detok", "stop", "text")

    def __init__(self, tokenizer: Tokenizer, req: Request) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        p = req.params
        self.stop = StopStrings(p.stop, p.include_stop_str_in_output) if p.stop else None
        self.text = ""  # what was emitted so far


class OutputProcessor:
    """Detokenizers and output text per request; without a tokenizer (a simulated engine) no text."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[str, _RequestText] = {}
        self._prompt_sent: set[str] = set()  # requests whose prompt log probabilities went out

    def add(self, req_id: str) -> None:
        pass  # a request's state is made with its first token, from its sampling params


    def release(self, req_id: str) -> None:
        self._texts.pop(req_id, None)
        self._prompt_sent.discard(req_id)

    def text(self, req_id: str) -> str:
        """The text emitted so far; once the request finished, its whole text (cut before a stop string)."""
        st = self._texts.get(req_id)
        return "" if st is None else st.text

    def process(self, new_tokens: list[tuple[Request, int]], logprobs: dict[str, list[TokenLogprob]] | None = None
                ) -> tuple[list[RequestOutput], list[str]]:
        """One RequestOutput per new token, in order, and the ids of the requests that ended on a stop
        string this step (for the scheduler to finish with reason "stop"). A request's outputs after
        its stop string already read finished, reason "stop". A request that the scheduler finished
        this step (its length, a stop token) finishes on its last token of the step: the earlier ones
        (accepted speculative guesses) read as running and carry their text. `logprobs` (the runner's,
        for the requests that asked) ride on each token's output; a request's prompt log probabilities
        (SamplingParams.prompt_logprobs, scored by then) on its first."""
        outputs, stopped = self._process(new_tokens, logprobs)
        for k, (req, _) in enumerate(new_tokens):
            if req.params.prompt_logprobs is not None and req.req_id not in self._prompt_sent:
                self._prompt_sent.add(req.req_id)
                outputs[k] = replace(outputs[k], prompt_logprobs=tuple(req.prompt_logprobs))
        return outputs, stopped

    def _process(self, new_tokens: list[tuple[Request, int]], logprobs: dict[str, list[TokenLogprob]] | None
                 ) -> tuple[list[RequestOutput], list[str]]:
        if logprobs:
            return self._with_logprobs(new_tokens, logprobs)
        if self.tokenizer is None:
            return [RequestOutput(req.req_id, (tok,), "", req.finished, req.finish_reason)
                    for req, tok in new_tokens], []
        last = {req.req_id: i for i, (req, _) in enumerate(new_tokens)}
        outputs: list[RequestOutput] = []
        stopped: set[str] = set()
        order: list[str] = []
        texts = self._texts
        for i, (req, tok) in enumerate(new_tokens):
            rid = req.req_id
            if rid in stopped:  # ended on a stop string earlier this step: no text
                outputs.append(RequestOutput(rid, (tok,), "", True, "stop"))
                continue
            st = texts.get(rid)
            if st is None:
                st = texts[rid] = _RequestText(self.tokenizer, req)
            ends_here = req.finished and last[rid] == i
            if ends_here and req.finish_reason == "stop":
                # A stop token (or EOS): its own text is not output; held-back text is not a stop string.
                text = st.stop.flush() if st.stop is not None else ""
                st.text += text
                outputs.append(RequestOutput(rid, (tok,), text, True, "stop"))
                continue
            text = st.detok.push(tok)
            if st.stop is not None:
                text, hit = st.stop.push(text)
                if hit:
                    st.text += text
                    if not req.finished:  # (one the scheduler already ended keeps its reason)
                        stopped.add(rid)
                        order.append(rid)
                    outputs.append(RequestOutput(rid, (tok,), text, True, "stop"))
                    continue
                if ends_here:
                    text += st.stop.flush()
            st.text += text
            outputs.append(RequestOutput(rid, (tok,), text, ends_here, req.finish_reason if ends_here else None))
        return outputs, order

    def _with_logprobs(self, new_tokens: list[tuple[Request, int]], logprobs: dict[str, list[TokenLogprob]]
                       ) -> tuple[list[RequestOutput], list[str]]:
        outputs, stopped = self._process(new_tokens, None)
        seen: dict[str, int] = {}
        for k, out in enumerate(outputs):
            lps = logprobs.get(out.req_id)
            if lps is not None:
                j = seen.get(out.req_id, 0)
                seen[out.req_id] = j + 1
                if j < len(lps):
                    outputs[k] = replace(out, logprobs=lps[j])
        return outputs, stopped

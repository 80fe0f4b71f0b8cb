"""Output processing: the text of every request.

The scheduler owns token ids, counters and status; this owns what they read as: a detokenizer and the
output text per request. Each step, `process()` turns the step's new tokens into RequestOutputs (the
text delta of each token), checks stop strings and reports the requests that ended on one; the engine
tells the scheduler, whose `finish` is still the only thing that ends a request and frees its blocks.
A stop string cuts the text where it starts (the stop string itself is not part of the output), and a
request's later tokens in the same step carry no text.
"""

from __future__ import annotations

from kvcli.engine.detokenizer import IncrementalDetokenizer
from kvcli.engine.outputs import RequestOutput
from kvcli.engine.request import Request
from kvcli.model.tokenizer import Tokenizer


class _RequestText:
    __slots__ = ("detok", "text")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.text = ""


class OutputProcessor:
    """Detokenizers and output text per request; without a tokenizer (a simulated engine) no text."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[str, _RequestText] = {}

    def add(self, req_id: str) -> None:
        if self.tokenizer is not None:
            self._texts[req_id] = _RequestText(self.tokenizer)

    def release(self, req_id: str) -> None:
        self._texts.pop(req_id, None)

    def text(self, req_id: str) -> str:
        st = self._texts.get(req_id)
        return "" if st is None else st.text

    def process(self, new_tokens: list[tuple[Request, int]]) -> tuple[list[RequestOutput], list[str]]:
        """One RequestOutput per new token, in order, and the ids of the requests that ended on a stop
        string this step (for the scheduler to finish with reason "stop"). A request's outputs after
        its stop string already read finished, reason "stop"."""
        if self.tokenizer is None:
            return [RequestOutput(req.req_id, (tok,), "", req.finished, req.finish_reason)
                    for req, tok in new_tokens], []
        outputs: list[RequestOutput] = []
        stopped: list[str] = []
        texts = self._texts
        for req, tok in new_tokens:
            rid = req.req_id
            if req.finish_reason == "stop" or (stopped and rid in stopped):
                # Ended on a stop token (the scheduler), or on a stop string earlier this step: no text.
                outputs.append(RequestOutput(rid, (tok,), "", True, "stop"))
                continue
            st = texts[rid]
            text = st.detok.push(tok)
            stop = req.params.stop
            if stop:
                done = st.text
                joined = done + text
                hits = [joined.find(s, max(0, len(done) - len(s))) for s in stop]
                hits = [h for h in hits if h >= 0]
                if hits:
                    cut = min(hits)
                    text = joined[len(done):cut] if cut >= len(done) else ""
                    st.text = joined[:cut]
                    if not req.finished:  # (one the scheduler already ended keeps its reason)
                        stopped.append(rid)
                    outputs.append(RequestOutput(rid, (tok,), text, True, "stop"))
                    continue
            st.text += text
            outputs.append(RequestOutput(rid, (tok,), text, req.finished, req.finish_reason))
        return outputs, stopped

"""The Python API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvcli.config import SamplingParams
from kvcli.engine.llm_engine import EngineOptions, LLMEngine
from kvcli.engine.outputs import CompletionOutput, RequestOutput
from kvcli.model.loader import load_weights


class LLM:
    def __init__(self, model: str | None = None, *, quant: str = "auto", **options) -> None:
        self.engine = LLMEngine(load_weights(model, quant=quant), EngineOptions(**options))
        self.tokenizer = self.engine.tokenizer

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """The generate API over an engine built elsewhere (e.g. sharing weights with another engine)."""
        llm = cls.__new__(cls)
        llm.engine, llm.tokenizer = engine, engine.tokenizer
        return llm

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> list[CompletionOutput]:
        """Run all prompts together through the paged cache; `on_output` streams each new token.
        One result per prompt; with SamplingParams(n > 1) the other samples are in its `.samples`."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        ids = [self.engine.add_request(p, sp).req_id for p, sp in zip(prompts, plist)]
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if on_output:
                    on_output(out)
        return [self.engine.completion(i) for i in ids]

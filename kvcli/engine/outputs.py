"""What the engine hands back: per-step deltas for streaming, final results per request."""

from __future__ import annotations

from dataclasses import dataclass

from kvcli.step import TokenLogprob


@dataclass(frozen=True)
class RequestOutput:
    req_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    logprobs: TokenLogprob | None = None  # the token's, when the request asked for them
    # SamplingParams.prompt_logprobs, on a request's first output only: prompt tokens 1.. each given those
    # before it (the first prompt token has none; OpenAI's echo writes null for it)
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class CompletionOutput:
    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    ttft_s: float | None
    num_preemptions: int = 0
    samples: tuple["CompletionOutput", ...] = ()  # with SamplingParams(n > 1): the other n - 1 samples

"""A generation request: its tokens, how many of them are already in the KV cache, and its timings.

There are no prefill/decode phases: each step computes `num_tokens - num_computed_tokens` of a request
(capped by the step's token budget), so a prompt chunk and a decode token are the same kind of work.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvcli.config import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass
class Request:
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_preemptions: int = 0
    swapped_blocks: int = 0  # host blocks held while swapped out
    dropped_tokens: int = 0  # set when it finishes: tokens its bounded cache dropped (Scheduler.dropped_tokens)
    skip_to_window: bool = False  # bounded cache: rebuild only the sinks and the last W tokens (scheduler.py)
    parent_id: str | None = None  # set on the samples forked from one prompt (n > 1)
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache when first scheduled
    # SamplingParams.prompt_logprobs: prompt tokens 1.. scored so far (the runner's, appended per step)
    prompt_logprobs: list = field(default_factory=list)

    @property
    def scores_prompt(self) -> bool:
        """Still to score prompt tokens: its chunks carry targets and it takes no prefix-cache hit."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) without building the whole prompt + output list (hot path)."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

"""What one engine step hands from the scheduler to the runner and back: plain data, no behaviour.

The scheduler (engine/) produces a SchedulerOutput, the runner (runner/) executes it and returns a
RunnerOutput, the scheduler applies that. Both sides import these types from here, so neither
package depends on the other (as vLLM keeps them in sched/output.py and outputs.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvcli.config import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class NewRequest:
    """A request the runner has not seen: what it needs to sample for it."""

    req_id: str
    params: SamplingParams
    prompt_ids: tuple[int, ...] = ()  # set when the params' repetition penalty needs them


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's share of a step, as plain data for the model runner."""

    req_id: str
    token_ids: list[int]  # the tokens to compute this step
    start_pos: int  # absolute position of token_ids[0] (= tokens already in the cache)
    block_table: list[int]
    sample: bool  # this chunk reaches the end of the known tokens: sample the next one
    fork_ids: tuple[str, ...] = ()  # samples of the same prompt that branch off here (n > 1)
    spec_token_ids: tuple[int, ...] = ()  # guesses: the last len() entries of token_ids, to verify
    # A request that asked for its prompt's log probabilities: the prompt token after each of the first
    # len() entries of token_ids (the chunk's rows to score; the last prompt token has none of its own).
    prompt_targets: tuple[int, ...] = ()
    # KV groups past the first (kvcache/kv_groups.py: Gemma's windowed layers): their tables, the same length as
    # block_table, in group order. Empty with one table for every layer.
    group_tables: tuple[list[int], ...] = ()


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    preempted: list[str] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    swap_out: list[tuple[str, list[int]]] = field(default_factory=list)  # (req, blocks) -> host
    swap_in: list[tuple[str, list[int]]] = field(default_factory=list)  # host -> (req, new blocks)
    finished: list[str] = field(default_factory=list)  # ended by the scheduler (pool cannot hold them)
    new_blocks: list[int] = field(default_factory=list)  # first use: zero before anything is written
    new_requests: list[NewRequest] = field(default_factory=list)
    released: list[str] = field(default_factory=list)  # finished since the last step: drop runner state
    # Bounded caches (kvcache/retention.py): kept window keys to re-rotate after blocks were dropped,
    # performed after the copies and before the step's writes (KeyShift: req_id, blocks, delta).
    key_shifts: list = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass(frozen=True)
class RunnerOutput:
    """What the runner hands back: sampled tokens per request (and, for teacher forcing, logits)."""

    sampled: dict[str, list[int]]
    logits: "torch.Tensor | None" = None  # [tokens, vocab] float32 when all logits were asked for
    # For requests that asked for them (ModelRunner.want_logprobs): per sampled token, its log
    # probability under the model's distribution (raw logits, before temperature / top-k / top-p, as
    # vLLM and OpenAI report them) and the top entries as (token id, log probability).
    logprobs: "dict[str, list[TokenLogprob]] | None" = None
    # Chunks with prompt_targets: per target, in order, its log probability and top entries (same rules).
    prompt_logprobs: "dict[str, list[TokenLogprob]] | None" = None


@dataclass(frozen=True)
class TokenLogprob:
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

"""Statistics records, each produced by the part that owns the numbers; the collector combines them
into a Snapshot. Plain frozen dataclasses: nothing here points back at a live object.

  SchedulerStats  queues, preemptions, and the extent of every live request (scheduler)
  KVLayoutStats   blocks, sharing, prefix-cache counters and the slot breakdown (the KV layout)
  SpecStats       speculative decoding: guesses proposed and accepted (scheduler)
  RunStats        step count, token counters and time spent in prefill and decode (engine)
  EngineFacts     what does not change while an engine runs: KV geometry, dtype, weights (engine)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestExtent:
    """A live request as the KV layouts and metrics see it."""

    req_id: str
    num_tokens: int  # tokens whose K/V are in the cache (final ones: accepted)
    final_tokens: int  # the most it can ever hold: min(prompt + max_tokens, max_model_len)


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    num_preemptions: int  # so far
    running: tuple[RequestExtent, ...]  # in admission order
    next_waiting: int | None  # final tokens of the request first in line (None: none waits)


@dataclass(frozen=True)
class KVLayoutStats:
    """Counts in blocks and token slots; bytes are the collector's business (it knows the KV dtype)."""

    layout: str
    block_size: int
    num_blocks: int  # usable blocks (the null block excluded)
    used_blocks: int
    shared_saved_blocks: int  # blocks not allocated thanks to sharing: sum of (ref_cnt - 1)
    prefix_query_tokens: int
    prefix_hit_tokens: int
    # The vLLM paper's Fig. 2 categories, in slots (see metrics/snapshot.py).
    token_slots: int
    reserved_slots: int
    internal_slots: int
    external_slots: int
    free_slots: int


@dataclass(frozen=True)
class RunStats:
    step: int
    prompt_tokens: int  # prompt tokens computed (prefill work)
    generated_tokens: int
    decode_tokens: int  # tokens sampled in decode-only steps
    prefill_seconds: float
    decode_seconds: float
    cpu_threads: int = 0  # the kernels' CPU threads now (runner/threads.py; 0: not on the CPU)
    threads_auto: bool = False  # --threads auto: tuned by timing decode steps
    thread_switches: int = 0  # times the tuner changed the count


@dataclass(frozen=True)
class SpecStats:
    """Speculative decoding so far. request_steps: scheduled steps in which a request sampled (each
    appends 1 token without speculation, up to 1 + k with it)."""

    enabled: bool = False
    proposed: int = 0  # guessed tokens sent for verification
    accepted: int = 0  # of those, the ones the model agreed with
    verifications: int = 0  # request-steps that carried guesses
    request_steps: int = 0
    request_step_tokens: int = 0  # tokens appended in those request-steps
    paused: int = 0  # running requests whose guessing is paused (low recent acceptance)


@dataclass(frozen=True)
class EngineFacts:
    """An engine's fixed figures, given to the collector once (it holds no engine)."""

    block_size: int
    bytes_per_block: int
    kv_pool_bytes: int  # the usable blocks and the null block
    kv_dtype: str  # e.g. "float16", "fp8"
    max_model_len: int
    weight_bytes: tuple[tuple[str, int], ...] = ()
    # One token's K/V over every layer (0: bytes_per_block / block_size; with KV groups a block is a page of
    # fewer layers, kvcache/kv_groups.py).
    token_bytes: int = 0  # (part, resident bytes), e.g. ("layers", ...)
    speculate: str = "none"  # the speculation method
    num_speculative_tokens: int = 0
    draft_length: str = "fixed"  # adaptive | fixed (options.DRAFT_LENGTHS)

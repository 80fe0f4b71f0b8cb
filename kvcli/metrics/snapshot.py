"""Immutable per-step metric snapshots: everything a view (live dashboard, summary, profile report)
may read. Views import this module and nothing else from kvcli's engine.

Byte accounting of KV memory follows the vLLM paper's Fig. 2 breakdown:
  token_bytes     slots holding a token's K/V
  reserved_bytes  slots set aside for tokens a request has not produced yet (contiguous layouts)
  internal_bytes  allocated slots that will never hold a token (unused tail of a partially filled
                  block in paged mode; the part of a reservation beyond the request's final length)
  external_bytes  free memory that no waiting request can use (holes too small, contiguous layouts)
  free_bytes      the rest of the pool
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class KVBreakdown:
    token_bytes: int
    reserved_bytes: int
    internal_bytes: int
    external_bytes: int
    free_bytes: int

    @property
    def allocated_bytes(self) -> int:
        return self.token_bytes + self.reserved_bytes + self.internal_bytes

    @property
    def total_bytes(self) -> int:
        return self.allocated_bytes + self.external_bytes + self.free_bytes

    def share_of_allocated(self, part: str) -> float:
        """A category as a fraction of allocated KV memory (the paper's percentages)."""
        alloc = self.allocated_bytes
        return getattr(self, part) / alloc if alloc else 0.0


@dataclass(frozen=True)
class MemorySnapshot:
    """Device memory as the OS / driver / torch see it; fields are None where unknown."""

    device: str  # "cuda:0 NVIDIA H200" or "cpu"
    gpu_found: bool
    device_total_bytes: int | None = None  # NVML
    device_used_bytes: int | None = None  # NVML, whole device
    process_used_bytes: int | None = None  # NVML per-process where reported, else process RSS on CPU
    torch_allocated_bytes: int | None = None
    torch_reserved_bytes: int | None = None  # reserved - allocated = allocator fragmentation
    kv_pool_bytes: int = 0
    weight_bytes: int = 0
    note: str = ""  # e.g. "no GPU found: showing process RSS"


@dataclass(frozen=True)
class BlockMap:
    """One entry per KV block. owner: -1 free, -2 cached-free (prefix cache), else the index of the
    owning request in `owners`; fill: tokens held (0..block_size); ref: reference count."""

    block_size: int
    owner: tuple[int, ...]
    fill: tuple[int, ...]
    ref: tuple[int, ...]
    owners: tuple[str, ...]  # request ids, indexed by owner
    # Per block: True if a bounded cache's retention rule gave it back to the pool this run (it may be free
    # again, or held once more: recycled). Empty when nothing is tracked (no --kv-window).
    recycled: tuple[bool, ...] = ()
    # Per block: the KV group whose table holds it (kvcache/kv_groups.py: Gemma's windowed layers keep their own
    # tables), an index into group_names. Empty with one table for every layer.
    group: tuple[int, ...] = ()
    group_names: tuple[str, ...] = ()


@dataclass(frozen=True)
class WindowSummary:
    """A bounded KV cache (--kv-window W, --sink-tokens S; kvcache/retention.py) and what it has given back
    so far. Read from the KV layout's public state (metrics/window.py)."""

    sink_tokens: int  # S as asked
    sink_slots: int  # the sinks in whole blocks (never dropped)
    window: int  # W
    max_slots: int  # the most KV tokens one request can hold: sink_slots + W + block_size - 1
    dropped_tokens: int = 0  # text tokens whose KV was dropped, over the run (every request)
    recycled_blocks: int = 0  # blocks the drops handed back to the pool, over the run
    peak_tokens: int = 0  # the most KV tokens one request has held (the layout's measure)


@dataclass(frozen=True)
class RequestTiming:
    req_id: str
    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None
    itl_s: tuple[float, ...]  # inter-token latencies of this request so far


def draft_limit(k: int, adaptive: bool) -> str:
    """How speculation's guesses per step are bounded, as the views say it: 'k=5', or 'k<=5 adaptive'."""
    return f"k<={k} adaptive" if adaptive else f"k={k}"


@dataclass(frozen=True)
class SpecSummary:
    """Speculative decoding so far (all zero when it is off)."""

    method: str = "none"  # none | ngram
    k: int = 0  # most guesses per step
    adaptive: bool = False  # each step verifies as many of the k as pay (--draft-length adaptive)
    proposed: int = 0
    accepted: int = 0
    verifications: int = 0  # request-steps that carried guesses
    request_steps: int = 0  # request-steps that sampled
    request_step_tokens: int = 0  # tokens those appended
    paused: int = 0  # running requests not guessing now (low recent acceptance)
    last_step_guesses: int = 0  # KV slots the last step held for guesses (given back unless accepted)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_draft(self) -> float:
        """Guesses a verification carried on average (k with a fixed length and guesses enough)."""
        return self.proposed / self.verifications if self.verifications else 0.0

    @property
    def limit(self) -> str:
        return draft_limit(self.k, self.adaptive)

    @property
    def tokens_per_request_step(self) -> float:
        """Mean tokens a request gains per step it samples in (1.0 without speculation)."""
        return self.request_step_tokens / self.request_steps if self.request_steps else 0.0


@dataclass(frozen=True)
class Snapshot:
    """The one record every view reads: the live dashboard, the plain log, the end-of-run summary."""

    step: int
    time_s: float  # seconds since the engine started
    layout: str  # "paged" | "contiguous"
    num_running: int
    num_waiting: int
    num_preempted: int  # preemptions so far
    kv: KVBreakdown
    contiguous_whatif: KVBreakdown | None  # the live requests under max-len contiguous preallocation
    whatif_fits: int | None  # how many requests that preallocation could hold at once in this pool
    blocks: BlockMap | None  # None unless asked for (a walk over every block)
    memory: MemorySnapshot | None  # None unless asked for (a probe of the device)
    tokens_per_s: tuple[float, ...] = ()  # recent output-token throughput samples, oldest first
    prompt_tokens: int = 0  # prompt tokens computed (prefill work)
    generated_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    requests: tuple[RequestTiming, ...] = field(default_factory=tuple)
    # Run totals, for summaries.
    num_swapped: int = 0
    num_blocks: int = 0
    block_size: int = 0
    blocks_used: int = 0
    peak_blocks_used: int = 0
    peak_shared_blocks: int = 0  # blocks not allocated thanks to sharing (forks, prefix hits), at peak
    bytes_per_block: int = 0
    kv_pool_bytes: int = 0
    kv_dtype: str = ""
    max_model_len: int = 0
    weight_bytes: dict[str, int] = field(default_factory=dict)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_tokens: int = 0  # tokens sampled in decode-only steps
    spec: SpecSummary = field(default_factory=lambda: SpecSummary())
    window: WindowSummary | None = None  # None: every request keeps all its KV (no --kv-window)
    token_kv_bytes: int = 0  # one token's K/V over every layer (0: a block's bytes over its slots)
    cpu_threads: int = 0  # the kernels' CPU threads at the end (0: not on the CPU)
    threads_auto: bool = False  # --threads auto (the count tuned by timing decode steps)
    thread_switches: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    @property
    def kv_bytes_per_token(self) -> int:
        """One token's K/V over every layer, scales included (without KV groups: a block's bytes over its slots)."""
        if self.token_kv_bytes:
            return self.token_kv_bytes
        return self.bytes_per_block // self.block_size if self.block_size else 0

    @property
    def peak_kv_bytes(self) -> int:
        return self.peak_blocks_used * self.bytes_per_block

    @property
    def total_weight_bytes(self) -> int:
        return sum(self.weight_bytes.values())

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tok_s(self) -> float:
        # The first token of each request comes out of its last prefill step.
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

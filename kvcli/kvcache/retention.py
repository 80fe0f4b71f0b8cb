"""The bounded-cache retention rule (attention sinks + a recent window), owned by the KV layout.

A request under a `Retention` keeps the KV of its first S tokens (the sinks) and of its last W tokens;
every block that falls wholly between them goes back to the pool (a block-table edit). The rule, exactly:

- **Sinks round up to whole blocks**: the first `sink_blocks = ceil(S / block_size)` blocks are kept whole
  and never move, so `sink_slots = sink_blocks * block_size` tokens (S = 4 at 16 tokens a block keeps the
  first 16 tokens). S = 0 keeps none.
- **The window rounds to whole blocks**: after the sinks, the table keeps the fewest trailing blocks that
  still hold at least W tokens once the step's tokens are written. Whole blocks are dropped from the front
  of the window just before a step would make the window part hold W + block_size tokens or more, and only
  blocks whose tokens are all computed. So the window part holds between W and W + block_size - 1 tokens
  (fewer only before the first drop), and the KV a request holds is at most
  `sink_slots + W + block_size - 1` tokens: S + W + one block + the partial sink block's padding
  (`max_slots`).
- A step's new tokens count inside the window: a windowed request's chunk (prefill chunk, decode token and
  speculative guesses together) is at most W tokens, so nothing not yet computed is ever dropped.

**Positions.** The block table stays compact (sink blocks, then window blocks, no holes), so every
attention backend just sees a shorter context: a request's *cache position* (what the rotary embedding
and the attention length use) is its token's index in the compact cache. Text token t sits at cache
position t below `sink_slots`, and at t - D past them, D = the tokens dropped so far (the layout's
`dropped_tokens`). Positions therefore never exceed `max_slots` - 1, however long the text: the model
only sees rotary positions it was trained on. When blocks are dropped, the kept window keys move D'
positions down: they are re-rotated by -D' (rotation composes: R(p - d) = R(-d) R(p); llama.cpp's context
shift, "K-shift"), one op over the kept blocks per layer, queued as a `KeyShift` for the runner, which
performs it before the step's writes. Keys in the cache are stored rotated (rotate-half layout); values
do not move. The cost: one pass over the window's keys every block_size tokens (decode), about
1 / (2 * block_size) of what attention reads in that time; for int8 / fp8 KV the pass is
dequantize -> rotate -> requantize, one more rounding of each kept key per shift (fp16/bf16: one
rounding to the storage dtype per shift; fp32: ~1 ulp).

**Prefix caching.** Blocks at true positions computed with their whole context are a reusable prefix;
anything written after a request's first drop is not. A request registers (and so offers to others)
only blocks written before its first drop; after it, only its sink blocks. A kept block that is
registered is taken out of the prefix index before it is re-rotated, and one shared with another request
(a prefix hit, an `n > 1` fork) is copied first (copy-on-write), so a shift never changes another
request's keys.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcli.kvcache.interface import blocks_for


@dataclass(frozen=True)
class Retention:
    sink_tokens: int  # S
    window: int  # W
    block_size: int

    def __post_init__(self) -> None:
        if self.sink_tokens < 0 or self.window < 1:
            raise ValueError(f"retention needs sink_tokens >= 0 and window >= 1 (got {self.sink_tokens}, {self.window})")

    @property
    def sink_blocks(self) -> int:
        return blocks_for(self.sink_tokens, self.block_size)

    @property
    def sink_slots(self) -> int:
        return self.sink_blocks * self.block_size

    @property
    def max_slots(self) -> int:
        """The most KV tokens a request ever holds: sink_slots + W + block_size - 1."""
        return self.sink_slots + self.window + self.block_size - 1

    def cache_position(self, text_index: int, dropped: int) -> int:
        """Where text token `text_index` (one not dropped) sits in a compact cache that dropped `dropped`."""
        return text_index if dropped == 0 or text_index < self.sink_slots else text_index - dropped

    def tokens_to_skip(self, dropped: int, num_computed: int, num_tokens: int) -> int:
        """A rebuild (after a recompute preemption, or a prompt kept rather than streamed): with exactly the
        sinks cached and nothing dropped yet, the tokens between the sinks and the last W, to count as dropped
        without computing them (0: nothing to skip)."""
        if dropped or num_computed != self.sink_slots:
            return 0
        return max(0, num_tokens - num_computed - self.window)

    def blocks_to_drop(self, cached_after: int, cached_computed: int, table_blocks: int) -> int:
        """Window blocks to drop before a step that leaves `cached_after` tokens in the compact cache, of which
        `cached_computed` are already computed; `table_blocks`: the request's blocks now."""
        window_part = cached_after - self.sink_slots
        if window_part < self.window + self.block_size:
            return 0
        k = (window_part - self.window) // self.block_size
        computed_window_blocks = max(0, cached_computed - self.sink_slots) // self.block_size
        return max(0, min(k, computed_window_blocks, table_blocks - self.sink_blocks))


@dataclass(frozen=True)
class KeyShift:
    """Re-rotate the keys of `blocks` (every layer) by -delta positions: the runner's job, before the step's
    writes and after its copy-on-write copies."""

    req_id: str
    blocks: tuple[int, ...]
    delta: int

"""The KV-layout interface: what the scheduler asks of a KV memory layout, written once.

Two layouts implement it completely: `PagedKVManager` (blocks on demand, vLLM-style) and
`ContiguousArena` (one region reserved per request at admission, as engines without paging do).
Each owns its admission rule (the paged watermark; the contiguous reservation and first fit, whose
failures are external fragmentation) and produces its own statistics. Both hand the runner the same
thing, a block table per request, so one set of attention kernels reads either.

With KV groups (kvcache/hybrid.py: Gemma's windowed layers) a request has one table per group over one
pool of equal pages; block operations name pages, whatever their group.

Block 0 of the pool is the null block: never handed to a request, zeroed once, and the value that
pads block tables, so a padded read lands on finite data that belongs to nobody.

A layout may also bound each request's KV (kvcache/retention.py: attention sinks + a recent window;
the paged layout implements it): then it owns which tokens are kept, where the kept ones sit
(`dropped_tokens`, `cache_position`) and the key re-rotations that keep positions compact
(`take_shifts`), while the scheduler keeps counting text tokens.

Request state is not kept here: the scheduler owns `num_computed_tokens` and tells the layout how
many slots a request needs (`allocate`, with slots ahead for tokens not accepted yet) and how many
it keeps (`truncate`, giving back the slots of rejected guesses).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from kvcli.metrics.snapshot import BlockMap
from kvcli.metrics.stats import KVLayoutStats, RequestExtent

NULL_BLOCK = 0


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVLayout(Protocol):
    name: str  # "paged" | "contiguous"
    block_size: int
    num_blocks: int  # blocks requests can get (the null block excluded)
    supports_sharing: bool  # prefix caching and copy-on-write forks

    @property
    def num_free_blocks(self) -> int: ...

    def block_table(self, req_id: str) -> list[int]: ...

    def group_tables(self, req_id: str) -> tuple[list[int], ...]:
        """Every KV group's table (kvcache/kv_groups.py), the first being `block_table`; one without groups."""

    def held_blocks(self, req_id: str) -> list[int]:
        """The blocks the request holds (null entries left out), every group's: what a swap-out copies and
        what a swap-in's fresh blocks are, in this order."""

    def blocks_to_admit(self, num_tokens: int, final_tokens: int) -> int:
        """Blocks a request of this size takes at admission (compared with num_blocks: can it ever run?)."""

    def admit(self, req_id: str, num_tokens: int, num_computed: int, final_tokens: int) -> bool:
        """Admission of a waiting (or swapped-out) request: slots for `num_tokens` under this layout's
        rule. False, with nothing held beyond what `match_prefix` took, if it must wait."""

    def allocate(self, req_id: str, num_tokens: int, num_computed: int) -> bool:
        """Grow an admitted request to `num_tokens` slots (tokens from `num_computed` on are written
        this step; slots past the accepted tokens may hold guesses). False, no change, if out of blocks."""

    def truncate(self, req_id: str, num_tokens: int) -> None:
        """Keep slots for the first `num_tokens` only (rejected guesses); emptied blocks go back."""

    def free(self, req_id: str, *, swapped: bool = False) -> None:
        """Give back a request's blocks. `swapped`: they were copied to host and return as they were, so
        per-request layout state (a retention rule's dropped tokens) is kept."""

    def match_prefix(self, req_id: str, prompt: list[int]) -> int:
        """Take cached blocks for the longest known prefix of a new request; returns tokens covered."""

    def cache_blocks(self, req_id: str, tokens: Callable[[int, int], list[int]], num_final: int) -> None:
        """Index the request's blocks that are full of final tokens (never a guess) for prefix reuse."""

    def fork(self, parent_id: str, child_id: str) -> None: ...

    def take_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write (src, dst) block copies queued since the last call."""

    def take_new_blocks(self) -> list[int]:
        """Blocks handed out for the first time since the last call (the runner zeroes them)."""

    def stats(self, running: Sequence[RequestExtent], next_waiting: int | None) -> KVLayoutStats:
        """`next_waiting`: final tokens of the request first in line (admission is first come, first
        served), for external fragmentation: free space that request cannot use."""

    def block_map(self, running: Sequence[RequestExtent]) -> BlockMap: ...

    def check_invariants(self) -> None: ...

"""KV cache groups: layers that share one block table, for models whose layers attend over different spans.

Gemma 2 / 3 interleave sliding-window layers (each query sees its last W keys) with global ones (every key).
With one block table per request every layer keeps every block, so a windowed layer holds the whole context
for nothing. Here, as in vLLM's hybrid KV cache manager, layers are grouped by the span they attend over,
and each group keeps its own table per request: the global group's table grows with the context, a windowed
group's table gives back every block wholly before its window (kvcache/block_manager.py, true positions).

**Pages of equal size.** Every group has the same number of layers (`slots`: the size of the smallest span
class; a class is split into groups of that many layers, its last group padded), so one block id names a
page of `slots` layers' K/V whatever the group, and all groups draw from one pool: memory is fungible
between them, admission and the statistics see one pool of equal blocks, and the KV tensors are one per
slot (kvcache/kv_cache.py: layer i reads slot `slot_of[i]` through its group's table). Gemma 3 (5 windowed
layers per global one, 26 layers): 4 slots, 1 global group and 6 windowed groups (the last with 2 layers,
its pages' two other slots unused).

One group (every model with a single span: full attention, or Mistral's window in every layer) is the plain
layout: `slots` = every layer, each layer its own slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from kvcli.kvcache.block_manager import sliding_window_blocks
from kvcli.kvcache.interface import blocks_for


@dataclass(frozen=True)
class KVGroup:
    window: int  # keys each layer of the group attends over (0: every key)
    layers: tuple[int, ...]


@dataclass(frozen=True)
class KVGroups:
    groups: tuple[KVGroup, ...]
    slots: int  # layers per page (per block id); the KV tensors held per block: 2 x slots (K and V)
    num_layers: int

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1

    @cached_property  # (read at every forward: computed once)
    def group_of(self) -> tuple[int, ...]:
        """Per layer: its group's index."""
        out = [0] * self.num_layers
        for g, grp in enumerate(self.groups):
            for i in grp.layers:
                out[i] = g
        return tuple(out)

    @cached_property
    def slot_of(self) -> tuple[int, ...]:
        """Per layer: the KV tensor (slot) it reads and writes; one per layer without groups."""
        out = [0] * self.num_layers
        for grp in self.groups:
            for j, i in enumerate(grp.layers):
                out[i] = j
        return tuple(out)

    def pages_held(self, tokens: int, block_size: int, step_tokens: int) -> int:
        """Pages (blocks of `slots` layers) the paged layout holds for one request of `tokens` tokens computed up to
        `step_tokens` a step: every block in a global group, at most a window's blocks in a windowed one
        (block_manager.sliding_window_blocks)."""
        n = blocks_for(tokens, block_size)
        return sum(min(n, sliding_window_blocks(g.window, step_tokens, block_size)) if g.window else n
                   for g in self.groups)

    def describe(self) -> str:
        if not self.hybrid:
            return "one block table for every layer"
        full = [g for g in self.groups if not g.window]
        win = [g for g in self.groups if g.window]
        parts = []
        if full:
            parts.append(f"{len(full)} global ({_layers(sum(len(g.layers) for g in full))})")
        for w in sorted({g.window for g in win}):
            gs = [g for g in win if g.window == w]
            parts.append(f"{len(gs)} windowed (W {w:,}, {_layers(sum(len(g.layers) for g in gs))})")
        return f"{len(self.groups)} block tables per request, {_layers(self.slots)} each: " + ", ".join(parts)


def _layers(n: int) -> str:
    return f"{n} layer" + ("" if n == 1 else "s")


def single_group(num_layers: int, window: int = 0) -> KVGroups:
    return KVGroups((KVGroup(window, tuple(range(num_layers))),), num_layers, num_layers)


def kv_groups_for(windows: list[int]) -> KVGroups:
    """Groups for layers attending over `windows` (per layer; 0: every key). One group where all agree (its
    window: the widest, as the plain paged layout keeps it)."""
    n = len(windows)
    classes: dict[int, list[int]] = {}
    for i, w in enumerate(windows):
        classes.setdefault(w, []).append(i)
    if 0 not in classes or len(classes) == 1:  # every layer sees the same span, or every one slides
        return single_group(n, max(windows, default=0))
    size = min(len(v) for v in classes.values())
    groups = []
    for w in sorted(classes):  # the global group (window 0) first: its table is the request's main one
        layers = classes[w]
        groups.extend(KVGroup(w, tuple(layers[j:j + size])) for j in range(0, len(layers), size))
    return KVGroups(tuple(groups), size, n)


def kv_groups_of(config) -> KVGroups:
    """`config`: a kvcli.config.ModelConfig (layer_window)."""
    return kv_groups_for([config.layer_window(i) or 0 for i in range(config.num_layers)])

"""The KV block map: one glyph per block (or per group of blocks when the pool is larger than the
grid), colored by owning request. The glyph alone says the block's state, so the map still reads
under NO_COLOR; color only adds which request owns it (the legend also counts blocks per request).

Under a bounded cache (--kv-window) the map also shows the blocks cycling: a block the retention rule gave
back this run is `∘` while free and `▚` once a request holds it again (re-used), so a long request reads as
its sink blocks, a band of window blocks moving through the pool, and the trail it recycled behind it.

With KV groups (a Gemma model: its windowed layers keep their own block tables, kvcache/kv_groups.py) a full
block of a windowed group's table is `▒`, the global group's `█`, and the legend counts blocks per group.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from rich.console import Group
from rich.text import Span, Text

from kvcli.metrics.snapshot import BlockMap

FULL, PARTIAL, SHARED, CACHED, FREE = "█", "▄", "▓", "░", "·"
REUSED, RECYCLED = "▚", "∘"  # held again after a window drop gave it back; given back and free now
WINDOWED = "▒"  # a full block of a windowed KV group's table (per-group block tables)

# Plain ANSI names: they survive 8/16-color terminals, unlike hex colors which rich would
# approximate into near-duplicates. Owner i always gets PALETTE[i % len], so a request keeps its
# color from step to step.
PALETTE: tuple[str, ...] = (
    "bright_blue", "bright_green", "bright_magenta", "bright_cyan", "yellow", "bright_red",
    "blue", "green", "magenta", "cyan", "red", "bright_yellow",
)
DIM = "dim"
MAX_LEGEND_OWNERS = 12

# A block's state is one int: owner * 8 + kind for owned blocks, -1 free, -2 cached-free, -3 recycled (free).
_K_FULL, _K_PARTIAL, _K_SHARED, _K_REUSED, _K_WINDOWED = 0, 1, 2, 3, 4
_KEY_FREE, _KEY_CACHED, _KEY_RECYCLED = -1, -2, -3
_KIND_GLYPH = (FULL, PARTIAL, SHARED, REUSED, WINDOWED)
_KIND_NAMES = ("full", "partial", "shared", "re-used", "windowed")
# Ties inside an aggregated cell go to the most informative state.
_KIND_PRIORITY = (3, 5, 6, 4, 3)  # full, partial, shared, re-used, windowed; cached-free 2, recycled 1, free 0


def owner_style(owner: int) -> str:
    return PALETTE[owner % len(PALETTE)]


def _block_keys(bm: BlockMap) -> list[int]:
    bs = bm.block_size
    # Shared wins over partial: a shared block's fill is the common prefix, not "this request's
    # unfinished tail". Partial wins over re-used: the window's head block is where the request writes.
    if bm.group:  # KV groups: a full block of a windowed group's table is drawn apart
        windowed = [name != "global" for name in bm.group_names]
        return [
            o if o < 0 else o * 8 + (_K_SHARED if r > 1 else _K_PARTIAL if f < bs else
                                     _K_WINDOWED if windowed[g] else _K_FULL)
            for o, f, r, g in zip(bm.owner, bm.fill, bm.ref, bm.group)
        ]
    if not bm.recycled:
        return [
            o if o < 0 else o * 8 + (_K_SHARED if r > 1 else _K_PARTIAL if f < bs else _K_FULL)
            for o, f, r in zip(bm.owner, bm.fill, bm.ref)
        ]
    return [
        (_KEY_RECYCLED if o == _KEY_FREE and rc else o) if o < 0 else
        o * 8 + (_K_SHARED if r > 1 else _K_PARTIAL if f < bs else _K_REUSED if rc else _K_FULL)
        for o, f, r, rc in zip(bm.owner, bm.fill, bm.ref, bm.recycled)
    ]


def _priority(key: int) -> int:
    if key == _KEY_FREE:
        return 0
    if key == _KEY_RECYCLED:
        return 1
    if key == _KEY_CACHED:
        return 2
    return _KIND_PRIORITY[key & 7]


def blocks_per_cell(num_blocks: int, width: int, height: int) -> int:
    """How many blocks one grid cell stands for so that all blocks fit in width x height."""
    return max(1, math.ceil(num_blocks / max(1, width * max(1, height))))


def cell_keys(bm: BlockMap, width: int, height: int,
              keys: list[int] | None = None) -> tuple[int, list[int]]:
    """(blocks per cell, state key of each cell); an aggregated cell takes its blocks' most
    common state, ties going to owned over cached-free over recycled over free."""
    keys = _block_keys(bm) if keys is None else keys
    k = blocks_per_cell(len(keys), width, height)
    if k == 1:
        return 1, keys
    cells: list[int] = []
    for i in range(0, len(keys), k):
        chunk = keys[i:i + k]
        first = chunk[0]
        if chunk.count(first) == len(chunk):  # the common case: a run of one request / free
            cells.append(first)
            continue
        counts = Counter(chunk)
        cells.append(max(counts, key=lambda key: (counts[key], _priority(key))))
    return k, cells


def _glyph_style(key: int) -> tuple[str, str]:
    if key == _KEY_FREE:
        return FREE, DIM
    if key == _KEY_CACHED:
        return CACHED, DIM
    if key == _KEY_RECYCLED:
        return RECYCLED, DIM
    owner, kind = divmod(key, 8)
    style = owner_style(owner)
    return _KIND_GLYPH[kind], (f"bold {style}" if kind == _K_SHARED else style)


def render_grid(bm: BlockMap, width: int, height: int,
                block_keys: list[int] | None = None) -> tuple[int, Text]:
    """(blocks per cell, the grid as one no-wrap Text of rows of at most `width` cells)."""
    width = max(1, width)
    k, keys = cell_keys(bm, width, height, block_keys)
    plain: list[str] = []
    spans: list[Span] = []
    pos = 0
    run_start, run_style = 0, ""
    # One span per run of equal style keeps the Text small: rendering cost scales with runs
    # (a request's blocks are mostly contiguous), not with cells.
    for i, key in enumerate(keys):
        if i and i % width == 0:
            plain.append("\n")
            pos += 1
        glyph, style = _glyph_style(key)
        if style != run_style:
            if run_style and pos > run_start:
                spans.append(Span(run_start, pos, run_style))
            run_start, run_style = pos, style
        plain.append(glyph)
        pos += 1
    if run_style and pos > run_start:
        spans.append(Span(run_start, pos, run_style))
    return k, Text("".join(plain), spans=spans, no_wrap=True, overflow="crop")


def state_counts(bm: BlockMap, keys: list[int] | None = None) -> dict[str, int]:
    """Blocks per state, as named in the legend ("re-used" and "recycled" only count under a bounded cache,
    "windowed", there only with KV groups)."""
    counts = {"full": 0, "partial": 0, "shared": 0, "re-used": 0, "windowed": 0, "cached-free": 0, "recycled": 0,
              "free": 0}
    for key, n in Counter(_block_keys(bm) if keys is None else keys).items():
        if key == _KEY_FREE:
            counts["free"] += n
        elif key == _KEY_CACHED:
            counts["cached-free"] += n
        elif key == _KEY_RECYCLED:
            counts["recycled"] += n
        else:
            counts[_KIND_NAMES[key & 7]] += n
    if not bm.group:  # "windowed" names a state only with KV groups
        del counts["windowed"]
    return counts


def _legend(bm: BlockMap, k: int, keys: list[int], owner_blocks: Sequence[int]) -> Text:
    counts = state_counts(bm, keys)
    legend = Text(no_wrap=False, end="")
    states = [(FULL, "full"), (PARTIAL, "partial"), (SHARED, "shared"), (CACHED, "cached-free"), (FREE, "free")]
    if bm.recycled:  # a bounded cache: the blocks its window gave back, held again or free
        states[3:3] = [(REUSED, "re-used")]
        states[-1:-1] = [(RECYCLED, "recycled")]
    if bm.group:  # KV groups: full blocks of the windowed layers' tables
        states[1:1] = [(WINDOWED, "windowed")]
    for glyph, name in states:
        legend.append(glyph, style=DIM if glyph in (CACHED, RECYCLED, FREE) else "bold")
        legend.append(f" {name} {counts[name]:,}   ")
    legend.rstrip()
    size = f"{len(bm.owner):,} blocks x {bm.block_size} tokens"
    legend.append("\n" + size + (f" · 1 cell = {k:,} blocks (dominant state)" if k > 1 else ""))
    if bm.group:
        legend.append(" · held per KV group: " + _group_counts(bm))
    # Busiest requests first: with many requests the legend shows the ones that fill the map.
    order = sorted((i for i, n in enumerate(owner_blocks) if n), key=lambda i: -owner_blocks[i])
    if order:
        legend.append("\n")
    for i in order[:MAX_LEGEND_OWNERS]:
        legend.append(FULL, style=owner_style(i))
        legend.append(f" {bm.owners[i]} {owner_blocks[i]:,}   ")
    if len(order) > MAX_LEGEND_OWNERS:
        legend.append(f"+{len(order) - MAX_LEGEND_OWNERS} more requests")
    legend.rstrip()
    return legend


def _group_counts(bm: BlockMap) -> str:
    """Held blocks per KV group, groups of one window counted together: "global 2,048 · W 512 (6 tables) 396"."""
    held = Counter(g for g, o in zip(bm.group, bm.owner) if o >= 0)
    names: dict[str, list[int]] = {}
    for i, name in enumerate(bm.group_names):
        names.setdefault(name, []).append(i)
    parts = []
    for name, ids in names.items():
        tables = f" ({len(ids)} tables)" if len(ids) > 1 else ""
        parts.append(f"{name}{tables} {sum(held[i] for i in ids):,}")
    return " · ".join(parts)


def render_block_map(bm: BlockMap, width: int = 96, height: int = 16) -> Group:
    """The grid (`width` cells per row, at most `height` rows) above its legend."""
    keys = _block_keys(bm)
    k, grid = render_grid(bm, width, height, keys)
    owner_blocks = [0] * len(bm.owners)
    for o, n in Counter(bm.owner).items():
        if o >= 0:
            owner_blocks[o] = n
    return Group(grid, _legend(bm, k, keys, owner_blocks))

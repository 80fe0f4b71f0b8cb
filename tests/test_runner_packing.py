"""The runner's packing of a SchedulerOutput into tensors, checked against hand-worked values."""

from __future__ import annotations

import torch

from kvcli.kvcache.interface import NULL_BLOCK
from kvcli.runner.model_runner import build_metadata
from kvcli.step import ScheduledChunk, SchedulerOutput


def test_build_metadata_mixed_step():
    # Block size 8. a: a prefill chunk at positions 14..16 (14 -> block 9 offset 6, 16 -> block 4
    # offset 0); b: a decode with two guesses; c: a one-token decode.
    out = SchedulerOutput([
        ScheduledChunk("a", [10, 11, 12], 14, [3, 9, 4], False),
        ScheduledChunk("b", [20, 21, 22], 5, [7], True, spec_token_ids=(21, 22)),
        ScheduledChunk("c", [30], 9, [5, 6], True),
    ])
    ids, pos, meta, rows = build_metadata(out, 8, torch.device("cpu"))
    assert ids.tolist() == [10, 11, 12, 20, 21, 22, 30] and ids.dtype == torch.int64
    assert pos.tolist() == [14, 15, 16, 5, 6, 7, 9] and pos.dtype == torch.int64
    assert meta.slot_mapping.tolist() == [9 * 8 + 6, 9 * 8 + 7, 4 * 8, 7 * 8 + 5, 7 * 8 + 6, 7 * 8 + 7, 6 * 8 + 1]
    assert meta.cu_seqlens_q.tolist() == [0, 3, 6, 7] and meta.cu_seqlens_q.dtype == torch.int32
    assert meta.seq_lens.tolist() == [17, 8, 10] and meta.seq_lens_list == (17, 8, 10)
    assert meta.query_lens_list == (3, 3, 1) and meta.max_seqlen_q == 3 and meta.max_seq_len == 17
    assert meta.block_tables.dtype == torch.int32
    assert meta.block_tables.tolist() == [[3, 9, 4], [7, NULL_BLOCK, NULL_BLOCK], [5, 6, NULL_BLOCK]]
    assert rows == [3, 4, 5, 6]  # b: its last real token and both guesses; c: its token

"""KV groups on a Gemma-3-shaped model at 32k context (issue #27): the KV bytes one request holds with per-group
block tables (the windowed layers keep only their window's blocks) against one table for every layer (every
layer keeps every token, as if every layer were global), and the logits unchanged.

One random-weight model of Gemma 3's shape (5 windowed layers per global one; dummy weights: the KV arithmetic
and the equality do not depend on them), one text of --tokens random token ids, scored by `LLMEngine.score` (the
whole text prefilled in --chunk-token steps through the KV layout and the cache, every position's logits
reduced to its next token's log probability) by two engines over the same model: KV groups on (the default) and
off (`kv_groups=False`). The peak is the layout's own count of the blocks the request held at once (every group
together), in bytes: blocks x the pool's bytes per block. "Logits unchanged": the two runs' per-token negative
log-likelihoods, compared bit for bit.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from kvcli.bench.harness import busy_note, load1


def main(argv: list[str] | None = None) -> int:
    import torch

    from kvcli.engine.llm_engine import LLMEngine
    from kvcli.model.loader import load_weights
    from kvcli.options import EngineOptions

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32768, help="context length and text length (default 32768)")
    ap.add_argument("--window", type=int, default=1024, help="the windowed layers' window (Gemma 3: 1024)")
    ap.add_argument("--layers", type=int, default=6, help="layers, every 6th global (default 6: 5 windowed + 1)")
    ap.add_argument("--chunk", type=int, default=512, help="tokens per prefill step (default 512)")
    a = ap.parse_args(argv)
    cfg = dict(model_type="gemma3_text", vocab_size=2048, hidden_size=128, intermediate_size=256,
               num_hidden_layers=a.layers, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
               sliding_window=a.window, max_position_embeddings=a.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "gemma3-shape.json"
        spec.write_text(json.dumps(cfg))
        loaded = load_weights(f"dummy:{spec}")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, cfg["vocab_size"], (a.tokens,), generator=g).tolist()
    model = None
    rows = {}
    before = load1()
    for groups in (True, False):
        e = LLMEngine(loaded, EngineOptions(max_model_len=a.tokens, kv_budget="256MiB", kv_dtype="fp16",
                                            max_num_batched_tokens=a.chunk, kv_groups=groups), model=model)
        model = e.model
        t0 = time.perf_counter()
        nll = e.score(ids)
        secs = time.perf_counter() - t0
        held = e.kv.peak_held_blocks
        rows[groups] = (e.kv_groups, held, held * e.bytes_per_block, e.bytes_per_block, nll, secs)
        print(f"{'KV groups' if groups else 'one table'} done in {secs:.1f} s", file=sys.stderr, flush=True)
    print(f"Gemma-3-shaped model: {a.layers} layers (every 6th global), window {a.window:,}, 1 KV head x 64, fp16 KV, "
          f"block 16, {a.tokens:,} tokens scored in {a.chunk}-token steps, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'layout':10} {'tables/request':>14} {'bytes/block':>11} {'peak blocks':>11} {'peak KV bytes':>14} "
          f"{'score s':>8}")
    for groups, (kg, held, nbytes, per_block, _, secs) in rows.items():
        print(f"{'KV groups' if groups else 'one table':10} {len(kg.groups):14} {per_block:11,} {held:11,} "
              f"{nbytes:14,} {secs:8.1f}")
    ratio = rows[True][2] / rows[False][2]
    same = torch.equal(rows[True][4], rows[False][4])
    diff = (rows[True][4] - rows[False][4]).abs().max().item()
    print(f"KV groups: {rows[True][0].describe()}")
    print(f"peak KV held with KV groups / one table for every layer: {ratio:.3f}x (goal <= 0.3x)")
    print(f"per-token NLL of the {a.tokens - 1:,} scored tokens identical: {same} (max abs difference {diff:.3g})")
    print(busy_note(before, load1()))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""What an int4 KV cache would cost in perplexity, measured before building one (issue: KV precision,
stretch goal "ship int4 only with a delta under 3 %").

Fake quantization: the fp32 cache of the torch backend holds int4-quantized-then-dequantized K/V, so
the perplexity is exactly that of a real int4 cache with the same scheme (only the bytes differ).
Schemes (4-bit, asymmetric min/max per group, as KIVI and transformers' QuantizedCache use):
  token-g32 : K and V per token, groups of 32 channels (streams like int8: a token's codes are final
              when written);
  kivi-g32  : V per token (groups of 32 channels); K per channel over groups of 32 tokens (one KV
              block of 32), quantized when the block fills; the last, partial block stays fp32 (KIVI's
              residual). The chunk that fills a block already attends to its quantized keys (KIVI
              attends in full precision during prefill: slightly pessimistic here).
Same text, model and window as the kv-dtype figure; prints one table and the machine line.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from kvcli.bench.harness import REPO

GROUP = 32


def fake_int4(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Asymmetric 4-bit round trip with min/max over groups of GROUP along `dim` (size divisible by GROUP)."""
    x = x.float().movedim(dim, -1)
    shape = x.shape
    g = x.reshape(*shape[:-1], shape[-1] // GROUP, GROUP)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    step = ((hi - lo) / 15).clamp_min(1e-8)
    q = torch.round((g - lo) / step).clamp(0, 15)
    return (q * step + lo).reshape(shape).movedim(-1, dim)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", type=Path, default=REPO / "samples" / "heldout-gpl-3.0.txt")
    ap.add_argument("--context", type=int, default=4096)
    a = ap.parse_args(argv)

    from kvcli.bench.internals import TorchAttentionBackend
    from kvcli.engine.llm_engine import LLMEngine
    from kvcli.bench.internals import perplexity
    from kvcli.model.loader import load_weights
    from kvcli.options import EngineOptions

    loaded = load_weights(None)
    ids = loaded.tokenizer.encode(a.text.read_text(encoding="utf-8"))[:a.context]
    write = TorchAttentionBackend.write_kv

    def token_g32(self, key, value, cache, meta):
        write(self, fake_int4(key, -1), fake_int4(value, -1), cache, meta)

    def kivi_g32(self, key, value, cache, meta):
        write(self, key, fake_int4(value, -1), cache, meta)
        bs = cache.block_size
        slots = meta.slot_mapping[meta.slot_mapping >= 0]
        full = (slots[slots % bs == bs - 1] // bs).tolist()  # blocks whose last slot was just written
        for blk in full:  # [bs tokens, kvh, D]: per channel over the block's tokens
            cache.k[blk] = fake_int4(cache.k[blk], 0)

    # Every K/V must go through write_kv to be fake-quantized: the fused rotary + KV-store C call (the
    # backend's optional rope_kv_writer) writes the cache itself, so it is declined here, for every row of
    # the table alike (scoring is prefill only: the one-call decode, which also writes K/V, does not run).
    rope_kv_writer = TorchAttentionBackend.rope_kv_writer
    TorchAttentionBackend.rope_kv_writer = lambda self, *args: None
    rows, model, base = [], None, None
    for name, hook in (("fp32", None), ("int4 token-g32", token_g32), ("int4 kivi-g32", kivi_g32)):
        TorchAttentionBackend.write_kv = hook or write
        e = LLMEngine(loaded, EngineOptions(kv_dtype="fp32", max_model_len=a.context, kv_budget="768MiB",
                                            block_size=GROUP, prefix_caching=False), model=model)
        model = e.model
        t = time.perf_counter()
        ppl = perplexity(e, ids, a.context, a.context).perplexity
        base = base or ppl
        rows.append((name, ppl, ppl / base - 1, time.perf_counter() - t))
        print(f"# {name}: {ppl:.4f} ({time.perf_counter() - t:.0f} s)", flush=True)
        del e
    TorchAttentionBackend.write_kv = write
    TorchAttentionBackend.rope_kv_writer = rope_kv_writer
    print(f"\ntext {a.text.name}, first {len(ids)} tokens, one window, {len(ids) - 1} scored; INT4 weights")
    print("| KV | perplexity | delta vs fp32 KV |")
    print("|---|---:|---:|")
    for name, ppl, rel, _ in rows:
        print(f"| {name} | {ppl:.4f} | {rel:+.3%} |")

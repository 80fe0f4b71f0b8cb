"""K-quant GGUFs against the bundled Q4_1 model: resident layer bytes, load time, decode speed (CPU).

Files (written once into .cache/, reused after):
  smollm2-q4_k_m.gguf   the bundled model re-encoded with llama.cpp's Q4_K_M choice (Q4_K, Q6_K for
                        attn_v/ffn_down). SmolLM2's hidden size 576 is not a multiple of 256, so like
                        llama.cpp every tensor with 576 columns takes the fallback type: Q4_K -> Q5_0,
                        Q6_K -> Q8_0. Only ffn_down (1536 columns) is a real K-quant (Q6_K).
  aligned-q4_1.gguf /   a random-weight llama with 256-aligned shapes (hidden 768, ffn 2048, 12
  aligned-q4_k_m.gguf   layers, SmolLM2's tokenizer), once Q4_1 and once Q4_K_M, so Q4_K itself is
                        measured. Random weights do not change the speed of a matmul.
Method: load = load_weights + engine construction (what a user waits for), best of --repeats, each
model alternately. Decode = greedy, --new-tokens from a --prompt-tokens prompt, tok/s of the
decode-only steps from the engine's own counters, best of --repeats rounds after a warm-up, the two
models' rounds alternating; the decode ratio is the median of the rounds' ratios (each round's pair
ran back to back), which one fast or slow round of this shared VM does not move.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from kvcli.bench.harness import REPO

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CACHE = REPO / ".cache"


def write_aligned(path: Path, quant: str) -> None:
    """A random llama with 256-aligned shapes: quant "Q4_1" everywhere, or the Q4_K_M choice."""
    import gguf
    import numpy as np

    from kvcli.bench.internals import kquant_encode
    add_tensor, copy_fields, encode, finish, q4_k_m_type = (kquant_encode.add_tensor, kquant_encode.copy_fields,
                                                            kquant_encode.encode, kquant_encode.finish,
                                                            kquant_encode.q4_k_m_type)
    from kvcli.model.loader import bundled_gguf_path

    hidden, inter, layers, heads, kv = 768, 2048, 12, 12, 4
    rng = np.random.default_rng(0)
    src = kquant_encode.open_reader(bundled_gguf_path())
    vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(path.stem)
    for add, v in [(w.add_block_count, layers), (w.add_context_length, 2048), (w.add_embedding_length, hidden),
                   (w.add_feed_forward_length, inter), (w.add_head_count, heads), (w.add_head_count_kv, kv),
                   (w.add_rope_dimension_count, hidden // heads), (w.add_vocab_size, vocab)]:
        add(v)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    copy_fields(src, w, keep=lambda key: key.startswith("tokenizer."))
    emb = (rng.standard_normal((vocab, hidden)) * 0.02).astype(np.float32)
    add_tensor(w, "token_embd.weight", encode(emb, "Q8_0"), "Q8_0")
    add_tensor(w, "output_norm.weight", np.ones(hidden, np.float32), "F32")
    d = hidden // heads
    shapes = {"attn_q": (hidden, hidden), "attn_k": (kv * d, hidden), "attn_v": (kv * d, hidden),
              "attn_output": (hidden, hidden), "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden),
              "ffn_down": (hidden, inter)}
    for i in range(layers):
        add_tensor(w, f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32), "F32")
        add_tensor(w, f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32), "F32")
        for name, (n, k) in shapes.items():
            full = f"blk.{i}.{name}.weight"
            t = quant if quant == "Q4_1" else q4_k_m_type(full, (n, k), "F32")
            x = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
            add_tensor(w, full, encode(x, t), t)
    finish(w)


def ensure_files(force: bool, aligned: bool) -> dict[str, tuple[Path, Path]]:
    from kvcli.bench.internals import kquant_encode
    q4_k_m_type, reencode_gguf = kquant_encode.q4_k_m_type, kquant_encode.reencode_gguf
    from kvcli.model.loader import bundled_gguf_path

    CACHE.mkdir(exist_ok=True)
    bundled = bundled_gguf_path()
    km = CACHE / "smollm2-q4_k_m.gguf"
    if force or not km.exists():
        t = time.perf_counter()
        counts = reencode_gguf(str(bundled), str(km), q4_k_m_type)
        print(f"wrote {km.name} in {time.perf_counter() - t:.1f} s: {counts}")
    pairs = {"SmolLM2-135M (bundled)": (bundled, km)}
    if aligned:
        a1, ak = CACHE / "aligned-q4_1.gguf", CACHE / "aligned-q4_k_m.gguf"
        for p, q in ((a1, "Q4_1"), (ak, "Q4_K_M")):
            if force or not p.exists():
                t = time.perf_counter()
                write_aligned(p, q)
                print(f"wrote {p.name} in {time.perf_counter() - t:.1f} s")
        pairs["aligned 768/2048 x 12 (random)"] = (a1, ak)
    return pairs


def file_bytes(path: Path) -> tuple[dict[str, tuple[int, int]], int]:
    """Per GGML type (count, bytes) over all tensors, and the bytes of the layer linears."""
    import gguf

    r = gguf.GGUFReader(str(path), "r")
    by: dict[str, tuple[int, int]] = {}
    layer_linear = 0
    for t in r.tensors:
        c, b = by.get(t.tensor_type.name, (0, 0))
        by[t.tensor_type.name] = (c + 1, b + int(t.n_bytes))
        if t.name.startswith("blk.") and len(t.shape) == 2:
            layer_linear += int(t.n_bytes)
    return by, layer_linear


def build(path: Path):
    from kvcli.engine.llm_engine import EngineOptions, LLMEngine
    from kvcli.llm import LLM
    from kvcli.model.loader import load_weights

    t = time.perf_counter()
    loaded = load_weights(str(path))
    llm = LLM.from_engine(LLMEngine(loaded, EngineOptions(prefix_caching=False, kv_budget="256MiB")))
    return llm, time.perf_counter() - t, loaded.load_seconds


def decode_tok_s(llm, ids: list[int], n: int, repeats: int, warm: bool = True) -> float:
    from kvcli.config import SamplingParams

    if warm:
        llm.generate([ids], SamplingParams(max_tokens=4, ignore_eos=True))
    best = 0.0
    for _ in range(repeats):
        before = llm.engine.stats()
        llm.generate([ids], SamplingParams(max_tokens=n, ignore_eos=True))
        after = llm.engine.stats()
        tokens = after.decode_tokens - before.decode_tokens
        best = max(best, tokens / (after.decode_seconds - before.decode_seconds))
    return best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-aligned", action="store_true", help="only the bundled model's re-encoding")
    ap.add_argument("--force", action="store_true", help="re-encode the files in .cache/")
    a = ap.parse_args(argv)


    sample = (REPO / "samples" / "keepers-log.txt").read_text(encoding="utf-8")
    for label, (base, kq) in ensure_files(a.force, not a.no_aligned).items():
        print(f"\n## {label}: {base.name} vs {kq.name}")
        results = {}
        loads: dict[Path, list[float]] = {base: [], kq: []}
        for _ in range(a.repeats):
            for p in (base, kq):
                llm, total, _ = build(p)
                loads[p].append(total)
                results[p] = llm
                del llm
        # decode rounds alternate between the two models: a slow phase of a shared VM weighs on both
        ids = results[base].tokenizer.encode(sample)[: a.prompt_tokens]
        rounds: dict[Path, list[float]] = {base: [], kq: []}
        for p in (base, kq):
            decode_tok_s(results[p], ids, 4, 0)  # warm-up
        for _ in range(a.repeats):
            for p in (base, kq):
                rounds[p].append(decode_tok_s(results[p], ids, a.new_tokens, 1, warm=False))
        for p in (base, kq):
            by, layer_file = file_bytes(p)
            llm = results[p]
            model = llm.engine.model
            resident = sum(lin.nbytes for l in model.layers for lin in (l.qkv, l.o, l.gate_up, l.down))
            tps = max(rounds[p])
            types = ", ".join(f"{k} x{c} ({b / 2**20:.1f} MiB)" for k, (c, b) in sorted(by.items()))
            print(f"{p.name}: tensors {types}")
            print(f"  linear paths {llm.engine.linear_mode}")
            print(f"  layer linears: file {layer_file / 2**20:.1f} MiB, resident {resident / 2**20:.1f} MiB "
                  f"({resident / layer_file:.3f}x)")
            print(f"  load (weights + engine) best of {a.repeats}: {min(loads[p]):.2f} s "
                  f"(all: {', '.join(f'{x:.2f}' for x in loads[p])})")
            print(f"  decode {tps:.2f} tok/s ({len(ids)}-token prompt, {a.new_tokens} new, best of {a.repeats} rounds "
                  f"alternating with the other model; all: {', '.join(f'{x:.1f}' for x in rounds[p])})")
            results[p] = (min(loads[p]), tps)
            del llm, model
        (lb, tb), (lk, tk) = results[base], results[kq]
        paired = sorted(k / b for b, k in zip(rounds[base], rounds[kq]))
        print(f"  => load {lk / lb:.2f}x the Q4_1 model's (goal <= 2x); decode {paired[len(paired) // 2]:.2f}x its "
              f"speed, the median of the rounds' ratios (goal >= 0.75x; ratios {', '.join(f'{r:.2f}' for r in paired)}; "
              f"best against best {tk / tb:.2f}x)")

"""The architectures beyond Llama against a Llama of the same weight bytes (issue #29's goal: decode on the CPU
within 15 % of the llama path's tok/s, INT4 GGUF forms kept packed: resident layer bytes within 15 % of the file's).

Files (random weights of one shape, written once into .cache/arch/, SmolLM2's tokenizer): hidden 768, ffn 2048,
12 layers, 12 heads / 4 KV heads of 64, Q4_0 linears, Q8_0 tied embedding, as
  llama    the reference
  qwen2    + q/k/v biases (Qwen2 / 2.5, and the text model of Qwen2-VL / 2.5-VL)
  qwen3    + per-head q/k RMSNorms
  phi3     q/k/v fused into attn_qkv, gate/up into ffn_up (split at load)
  gemma3   + q/k norms, sandwich norms, GeGLU, 5 sliding layers (window 512) per global one, two rotary bases
  gemma2   sandwich norms, GeGLU, every other layer sliding (window 512), attention and final logit soft-caps
The row "qwen2/layers" is the qwen2 file again with its one-call C decode turned off (every layer's kernels called from
Python, as before the C loop added q/k/v biases): what the one call is worth on it.
Method: greedy decode of --new-tokens after a --prompt-tokens prompt, tok/s of the decode steps from the engine's
counters; rounds alternate between the models (a slow phase of this shared VM weighs on all); each model's ratio
is the median over rounds of (its tok/s / the llama's in the same round).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from kvcli.bench.harness import REPO

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CACHE = REPO / ".cache" / "arch"
HIDDEN, INTER, LAYERS, HEADS, KV, D = 768, 2048, 12, 12, 4, 64
ARCHS = ("llama", "qwen2", "qwen3", "phi3", "gemma3", "gemma2")


def write(path: Path, arch: str) -> None:
    import gguf
    import numpy as np

    from kvcli.bench.internals import kquant_encode as ke
    from kvcli.model.loader import bundled_gguf_path

    rng = np.random.default_rng(0)
    src = ke.open_reader(bundled_gguf_path())
    vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(path.stem)
    for add, v in [(w.add_block_count, LAYERS), (w.add_context_length, 4096), (w.add_embedding_length, HIDDEN),
                   (w.add_feed_forward_length, INTER), (w.add_head_count, HEADS), (w.add_head_count_kv, KV),
                   (w.add_rope_dimension_count, D), (w.add_vocab_size, vocab), (w.add_key_length, D),
                   (w.add_value_length, D)]:
        add(v)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(512)
    if arch == "gemma2":  # Gemma 2's own caps (llama.cpp's defaults, written as its converter does)
        w.add_float32("gemma2.attn_logit_softcapping", 50.0)
        w.add_float32("gemma2.final_logit_softcapping", 30.0)
    ke.copy_fields(src, w, keep=lambda key: key.startswith("tokenizer."))

    def mat(n: int, k: int, t: str = "Q4_0") -> np.ndarray:
        return ke.encode((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32), t)

    ke.add_tensor(w, "token_embd.weight", ke.encode((rng.standard_normal((vocab, HIDDEN)) * 0.02).astype(np.float32),
                                                    "Q8_0"), "Q8_0")
    ones = np.ones(HIDDEN, np.float32)
    ke.add_tensor(w, "output_norm.weight", ones, "F32")
    for i in range(LAYERS):
        b = f"blk.{i}."
        ke.add_tensor(w, b + "attn_norm.weight", ones, "F32")
        ke.add_tensor(w, b + "ffn_norm.weight", ones, "F32")
        if arch in ("qwen3", "gemma3"):
            ke.add_tensor(w, b + "attn_q_norm.weight", np.ones(D, np.float32), "F32")
            ke.add_tensor(w, b + "attn_k_norm.weight", np.ones(D, np.float32), "F32")
        if arch in ("gemma2", "gemma3"):
            ke.add_tensor(w, b + "post_attention_norm.weight", ones, "F32")
            ke.add_tensor(w, b + "post_ffw_norm.weight", ones, "F32")
        if arch == "phi3":
            ke.add_tensor(w, b + "attn_qkv.weight", mat(HEADS * D + 2 * KV * D, HIDDEN), "Q4_0")
            ke.add_tensor(w, b + "ffn_up.weight", mat(2 * INTER, HIDDEN), "Q4_0")
        else:
            for name, n in (("attn_q", HEADS * D), ("attn_k", KV * D), ("attn_v", KV * D)):
                ke.add_tensor(w, b + name + ".weight", mat(n, HIDDEN), "Q4_0")
                if arch == "qwen2":
                    ke.add_tensor(w, b + name + ".bias", (rng.standard_normal(n) * 0.1).astype(np.float32), "F32")
            ke.add_tensor(w, b + "ffn_gate.weight", mat(INTER, HIDDEN), "Q4_0")
            ke.add_tensor(w, b + "ffn_up.weight", mat(INTER, HIDDEN), "Q4_0")
        ke.add_tensor(w, b + "attn_output.weight", mat(HIDDEN, HEADS * D), "Q4_0")
        ke.add_tensor(w, b + "ffn_down.weight", mat(HIDDEN, INTER), "Q4_0")
    ke.finish(w)


def layer_file_bytes(path: Path) -> int:
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path), "r").tensors
               if t.name.startswith("blk.") and len(t.shape) == 2)


def main(argv: list[str] | None = None) -> int:
    from kvcli.bench.kquants import build, decode_tok_s

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--force", action="store_true", help="write the files in .cache/arch again")
    a = ap.parse_args(argv)

    CACHE.mkdir(parents=True, exist_ok=True)
    files = {}
    for arch in ARCHS:
        p = CACHE / f"{arch}-768x12-q4_0.gguf"
        if a.force or not p.exists():
            t = time.perf_counter()
            write(p, arch)
            print(f"wrote {p.name} in {time.perf_counter() - t:.1f} s")
        files[arch] = p
    llms = {arch: build(p)[0] for arch, p in files.items()}
    llms["qwen2/layers"] = build(files["qwen2"])[0]
    llms["qwen2/layers"].engine.model.native_decode = None  # decode steps layer by layer
    rows = (*ARCHS, "qwen2/layers")
    sample = (REPO / "samples" / "keepers-log.txt").read_text(encoding="utf-8")
    ids = llms["llama"].tokenizer.encode(sample)[: a.prompt_tokens]
    for llm in llms.values():
        decode_tok_s(llm, ids, 4, 0)  # warm-up
    rounds: dict[str, list[float]] = {arch: [] for arch in rows}
    for _ in range(a.rounds):
        for arch in rows:
            rounds[arch].append(decode_tok_s(llms[arch], ids, a.new_tokens, 1, warm=False))
    print(f"\nshape: hidden {HIDDEN}, ffn {INTER}, {LAYERS} layers, {HEADS}/{KV} heads of {D}; Q4_0 linears, "
          f"Q8_0 tied embedding; {len(ids)}-token prompt, {a.new_tokens} new tokens, {a.rounds} rounds alternating")
    print(f"{'arch':12} {'decode tok/s (median)':>18} {'vs llama (median ratio)':>24} {'layer linears file':>19} "
          f"{'resident':>9} {'ratio':>6}  one-call C decode")
    for arch in rows:
        model = llms[arch].engine.model
        resident = sum(lin.nbytes for l in model.layers for lin in (l.qkv, l.o, l.gate_up, l.down))
        file_b = layer_file_bytes(files[arch.split("/")[0]])
        ratios = sorted(x / y for x, y in zip(rounds[arch], rounds["llama"]))
        tps = sorted(rounds[arch])[len(rounds[arch]) // 2]
        native = "yes" if model.native_decode is not None else (
            "off (this row)" if model.plan.native_decode else f"no ({model.plan.native_decode_why})")
        print(f"{arch:12} {tps:18.1f} {ratios[len(ratios) // 2]:23.3f}x {file_b / 2**20:16.1f} MiB "
              f"{resident / 2**20:5.1f} MiB {resident / file_b:5.3f}  {native}")
        print(f"{'':12} rounds: {', '.join(f'{x:.1f}' for x in rounds[arch])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

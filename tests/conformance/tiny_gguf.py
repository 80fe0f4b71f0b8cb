"""Tiny random-weight GGUFs for the conformance suite, written with gguf-py: one `Variant` per architecture and
per piece of semantics, each differing from the plain llama file in that piece only. All carry the bundled
model's tokenizer (so both engines see the same vocabulary), 2 layers (Gemma 3: 3, two sliding and one
global), and weights drawn so that logits spread over several units (a wrong rotary, norm or scale moves
them far beyond the comparison's tolerance).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


SPM_VOCAB = Path(__file__).resolve().parents[1] / "data" / "spm-vocab.json"  # tests/data/make_spm_vocab.py


@dataclass(frozen=True)
class Variant:
    name: str
    arch: str = "llama"
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int | None = None  # None: hidden / heads; else key_length = value_length (q width != hidden)
    ffn: int = 128
    layers: int = 2
    weights: str = "F32"  # the type of every linear (embedding: F32, or F16 for quantized files)
    tied: bool = False  # True: no output.weight, the embedding projects the vocabulary
    rope_base: float = 10000.0
    context: int = 512
    meta: dict = field(default_factory=dict)  # extra "<arch>.<key>": value (int -> uint32, float -> float32, str)
    rope_freqs: bool = False  # a rope_freqs.weight tensor (Llama 3.1+ files)
    rope_factors: bool = False  # rope_factors_long/short.weight tensors (Phi-3's longrope, no scaling type)
    bias: bool = False  # q/k/v biases (qwen2)
    out_bias: bool = False  # an attention output bias (attn_output.bias)
    qk_norm: bool = False  # per-head q/k RMSNorm (qwen3, gemma3)
    vocab: str = "bundled"  # "spm": tests/data/spm-vocab.json, a sentencepiece vocabulary (tokenizer.ggml.model "llama")
    general_name: str = "kvcli conformance file"
    drop_merges: int = 0  # n > 0: every n-th merge of the bundled vocabulary left out (whole words then differ)
    refused: bool = False  # llama.cpp refuses the file: kvcli must refuse it too, in one line
    note: str = ""  # what the variant checks, for the test ids' reader

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads


VARIANTS = [
    Variant("plain", note="llama, GQA 4/2, its own output.weight"),
    Variant("tied", tied=True, note="no output.weight: the embedding projects the vocabulary"),
    Variant("mqa", kv_heads=1, note="one KV head"),
    Variant("mha", kv_heads=4, note="as many KV heads as heads"),
    Variant("head-dim", head_dim=32, note="key_length 32 with 4 heads over hidden 64"),
    Variant("rope-base", rope_base=500000.0, note="rope.freq_base 500,000"),
    Variant("rope-freqs", rope_freqs=True, note="rope_freqs.weight divides the frequencies (Llama 3.1+)"),
    Variant("rope-linear", meta={"rope.scaling.type": "linear", "rope.scaling.factor": 4.0},
            note="positions divided by 4"),
    Variant("rope-yarn", meta={"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                               "rope.scaling.original_context_length": 128},
            note="yarn from 128 to 512 tokens, its attention factor"),
    Variant("rope-yarn-attn", meta={"rope.scaling.type": "yarn", "rope.scaling.factor": 8.0,
                                    "rope.scaling.original_context_length": 64,
                                    "rope.scaling.attn_factor": 0.8},
            note="yarn with rope.scaling.attn_factor"),
    Variant("rope-linear-freqs", rope_freqs=True, meta={"rope.scaling.type": "linear", "rope.scaling.factor": 2.0},
            note="linear scaling and rope_freqs together"),
    Variant("window-key", meta={"attention.sliding_window": 8},
            note="a llama file carrying attention.sliding_window"),
    Variant("qwen2", arch="qwen2", bias=True, rope_base=1e6, note="q/k/v biases, neox rotary"),
    Variant("llama-biases", bias=True, out_bias=True, note="q/k/v and attention output biases in a llama file"),
    Variant("qwen2-out-bias", arch="qwen2", bias=True, out_bias=True, refused=True,
            note="an attention output bias in a qwen2 file (llama.cpp's qwen2 graph has none; nor qwen3's, gemma3's or "
                 "phi3's, checked by hand)"),
    Variant("qwen2-window-key", arch="qwen2", bias=True, meta={"attention.sliding_window": 8},
            note="a qwen2 file carrying attention.sliding_window"),
    Variant("qwen2vl", arch="qwen2vl", bias=True, rope_base=1e6, meta={"rope.dimension_sections": [2, 3, 3, 0]},
            note="a Qwen2-VL / Qwen2.5-VL text model: M-RoPE, on text qwen2's rotary"),
    Variant("qwen2vl-sections", arch="qwen2vl", bias=True, meta={"rope.dimension_sections": [1, 1, 3, 0]},
            note="M-RoPE sections covering 5 of the 8 frequencies (llama.cpp wraps them): on text qwen2's rotary"),
    Variant("qwen3vl", arch="qwen3vl", qk_norm=True, head_dim=32, rope_base=1e6,
            meta={"rope.dimension_sections": [4, 6, 6, 0], "n_deepstack_layers": 1},
            note="a Qwen3-VL text model: qwen3 with interleaved M-RoPE (on text qwen3's rotary), deepstack for images"),
    Variant("qwen3-window-key", arch="qwen3", qk_norm=True, meta={"attention.sliding_window": 8},
            note="a qwen3 file carrying attention.sliding_window"),
    Variant("qwen3", arch="qwen3", qk_norm=True, head_dim=32, rope_base=1e6, note="per-head q/k norms, head_dim 32"),
    Variant("qwen3-tied", arch="qwen3", qk_norm=True, tied=True, note="qwen3 with a tied embedding"),
    Variant("gemma3", arch="gemma3", qk_norm=True, layers=3, head_dim=32, tied=True,
            meta={"attention.sliding_window": 8, "attention.sliding_window_pattern": 3,
                  "rope.freq_base_swa": 500.0},
            note="2 sliding layers (window 8, base 500) per global one, sandwich norms, GeGLU, scaled embedding"),
    Variant("gemma3-linear", arch="gemma3", qk_norm=True, layers=3, head_dim=32, tied=True,
            meta={"attention.sliding_window": 8, "attention.sliding_window_pattern": 3,
                  "rope.freq_base_swa": 500.0, "rope.scaling.type": "linear", "rope.scaling.factor": 4.0},
            note="gemma3 with linear scaling (global layers only)"),
    Variant("gemma3-attn-factor", arch="gemma3", qk_norm=True, layers=3, head_dim=32, tied=True,
            meta={"attention.sliding_window": 8, "attention.sliding_window_pattern": 3,
                  "rope.freq_base_swa": 500.0, "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                  "rope.scaling.original_context_length": 128, "rope.scaling.attn_factor": 0.8},
            note="gemma3 with yarn and rope.scaling.attn_factor"),
    # Gemma 2: caps small enough to bend these scores and logits (the real 50 and 30 barely touch random weights)
    Variant("gemma2", arch="gemma2", layers=3, head_dim=32, tied=True,
            meta={"attention.sliding_window": 8, "attn_logit_softcapping": 3.0, "final_logit_softcapping": 4.0},
            note="every other layer sliding (window 8), attention and final logit soft-capping, sandwich norms"),
    Variant("gemma2-defaults", arch="gemma2", layers=2, tied=True,
            note="gemma2 without window or cap keys: llama.cpp's defaults (window 4096, caps 50 and 30)"),
    Variant("gemma2-swa-base", arch="gemma2", layers=2, tied=True,
            meta={"attention.sliding_window": 8, "rope.freq_base_swa": 500.0, "attn_logit_softcapping": 3.0},
            note="gemma2 with its own rotary base for the sliding layers"),
    Variant("gemma2-output", arch="gemma2", layers=2, refused=True,
            note="an output.weight in a gemma2 file (llama.cpp's graph projects with the embedding)"),
    Variant("qwen2-rope-freqs", arch="qwen2", bias=True, rope_freqs=True, refused=True,
            note="rope_freqs.weight in a qwen2 file (llama.cpp's qwen2 graph has no such tensor)"),
    Variant("qwen3-rope-freqs", arch="qwen3", qk_norm=True, rope_freqs=True, refused=True,
            note="rope_freqs.weight in a qwen3 file"),
    Variant("gemma3-rope-freqs", arch="gemma3", qk_norm=True, layers=3, head_dim=32, tied=True, rope_freqs=True,
            meta={"attention.sliding_window": 8, "attention.sliding_window_pattern": 3}, refused=True,
            note="rope_freqs.weight in a gemma3 file"),
    Variant("phi3", arch="phi3", note="fused attn_qkv and a double-width ffn_up (gate half first)"),
    Variant("phi3-longrope", arch="phi3", rope_factors=True,
            meta={"rope.scaling.original_context_length": 128, "rope.scaling.attn_factor": 1.19},
            note="longrope as Phi-3's converter writes it (factor tensors, no scaling type): long factors"),
    Variant("phi3-longrope-short", arch="phi3", rope_factors=True,
            meta={"rope.scaling.original_context_length": 512, "rope.scaling.attn_factor": 1.0},
            note="longrope within the original context: the short factors"),
    Variant("phi3-longrope-typed", arch="phi3", rope_factors=True,
            meta={"rope.scaling.type": "longrope", "rope.scaling.original_context_length": 128,
                  "rope.scaling.attn_factor": 1.19}, note="longrope named by rope.scaling.type"),
    Variant("qwen3-rope-factors", arch="qwen3", qk_norm=True, rope_factors=True, refused=True,
            meta={"rope.scaling.original_context_length": 128},
            note="rope_factors_long/short in a qwen3 file (llama.cpp's qwen3 graph has no such tensors)"),
    Variant("bpe-llama3", meta={"tokenizer.ggml.pre": "llama-bpe"}, drop_merges=5,
            note="a Llama 3 pre-tokenizer, whose words are taken whole when they are tokens (ignore_merges); "
                 "every 5th merge left out, so merging alone would spell them otherwise"),
    # Sentencepiece vocabularies (Llama 2, Mistral, Gemma, Phi-3 files): logits on the ids both tokenizers give
    Variant("spm", vocab="spm", note="a sentencepiece vocabulary (tokenizer.ggml.model llama), space prefix"),
    Variant("spm-no-prefix", vocab="spm", meta={"tokenizer.ggml.add_space_prefix": False},
            note="a sentencepiece vocabulary without the space prefix (Gemma's files)"),
    Variant("spm-phi3", arch="phi3", vocab="spm", general_name="Phi3 mini", note="a Phi-3 file's vocabulary: "
            "llama.cpp strips the whitespace after its special tokens, by the name"),
    Variant("f16", weights="F16", note="F16 linears"),
    Variant("q8_0", weights="Q8_0", note="Q8_0 linears"),
    Variant("q4_0", weights="Q4_0", note="Q4_0 linears"),
    Variant("q4_1", weights="Q4_1", note="Q4_1 linears"),
    Variant("q4_k", weights="Q4_K", hidden=256, ffn=512, note="Q4_K linears (256-wide rows)"),
    Variant("q6_k", weights="Q6_K", hidden=256, ffn=512, note="Q6_K linears"),
]
BY_NAME = {v.name: v for v in VARIANTS}


def _meta(w, key: str, value) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, list) and all(isinstance(x, int) for x in value):
        w.add_array(key, value)  # int32, as llama.cpp's converter writes rope.dimension_sections
    else:
        raise TypeError(f"{key}: {value!r}")


def write(v: Variant, path: Path, seed: int = 0) -> Path:
    import gguf

    from kvcli.model.kquant_encode import add_tensor, copy_fields, encode, finish, open_reader
    from kvcli.model.loader import bundled_gguf_path

    rng = np.random.default_rng(seed)
    src = open_reader(bundled_gguf_path())
    spm = json.loads(SPM_VOCAB.read_text(encoding="utf-8")) if v.vocab == "spm" else None
    vocab = len(spm["tokens"]) if spm else len(src.fields["tokenizer.ggml.tokens"].data)
    h, d = v.hidden, v.dim
    w = gguf.GGUFWriter(str(path), v.arch)
    # general.name holds "phi3" / "phi-3" only where the vocabulary has Phi-3's special tokens: llama.cpp sets
    # Phi-3 token attributes by the name (the bundled vocabulary has none of them)
    w.add_name(v.general_name)
    w.add_block_count(v.layers)
    w.add_context_length(v.context)
    w.add_embedding_length(h)
    w.add_feed_forward_length(v.ffn)
    w.add_head_count(v.heads)
    w.add_head_count_kv(v.kv_heads)
    if v.head_dim is not None:
        w.add_key_length(d)
        w.add_value_length(d)
    w.add_rope_dimension_count(d)
    w.add_rope_freq_base(v.rope_base)
    gemma = v.arch in ("gemma2", "gemma3")
    w.add_layer_norm_rms_eps(1e-6 if gemma else 1e-5)
    w.add_vocab_size(vocab)
    for key, value in v.meta.items():
        _meta(w, key if key.startswith("tokenizer.") else f"{v.arch}.{key}", value)
    if spm:  # as llama.cpp's converter writes a sentencepiece vocabulary (tokenizer.* of meta also apply)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(spm["tokens"])
        w.add_token_scores(spm["scores"])
        w.add_token_types(spm["token_type"])
        w.add_bos_token_id(spm["bos"])
        w.add_eos_token_id(spm["eos"])
        w.add_unk_token_id(spm["unk"])
    else:  # the bundled vocabulary; tokenizer.* keys of meta replace its own, drop_merges thins its merges
        copy_fields(src, w, keep=lambda key: key.startswith("tokenizer.") and key not in v.meta
                    and not (v.drop_merges and key == "tokenizer.ggml.merges"))
        if v.drop_merges:
            merges = [str(m) for m in src.fields["tokenizer.ggml.merges"].contents()]
            w.add_token_merges([m for i, m in enumerate(merges) if i % v.drop_merges])

    def normal(*shape: int, std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def linear(name: str, n: int, k: int, std: float | None = None) -> None:
        data = normal(n, k, std=std or 1.0 / np.sqrt(k))
        add_tensor(w, name, data if v.weights == "F32" else encode(data, v.weights), v.weights)

    emb_type = "F32" if v.weights == "F32" else "F16"
    emb = normal(vocab, h, std=0.15 if gemma else 1.0)
    add_tensor(w, "token_embd.weight", emb if emb_type == "F32" else emb.astype(np.float16), emb_type)
    add_tensor(w, "output_norm.weight", 1 + normal(h, std=0.1), "F32")
    if not v.tied:
        linear("output.weight", vocab, h, std=3.0 / np.sqrt(h))
    if v.rope_freqs:  # Llama 3.1's shape: 1 for the fast frequencies, growing to 8 for the slow ones
        add_tensor(w, "rope_freqs.weight", np.linspace(1.0, 8.0, d // 2, dtype=np.float32) ** 1.5, "F32")
    if v.rope_factors:  # one divisor per rotary pair, long growing to 6 for the slow frequencies, short near 1
        add_tensor(w, "rope_factors_long.weight", np.linspace(1.0, 6.0, d // 2, dtype=np.float32) ** 1.3, "F32")
        add_tensor(w, "rope_factors_short.weight", np.linspace(1.0, 1.5, d // 2, dtype=np.float32), "F32")
    for i in range(v.layers):
        add_tensor(w, f"blk.{i}.attn_norm.weight", 1 + normal(h, std=0.1), "F32")
        add_tensor(w, f"blk.{i}.ffn_norm.weight", 1 + normal(h, std=0.1), "F32")
        if v.qk_norm:
            add_tensor(w, f"blk.{i}.attn_q_norm.weight", 1 + normal(d, std=0.3), "F32")
            add_tensor(w, f"blk.{i}.attn_k_norm.weight", 1 + normal(d, std=0.3), "F32")
        if gemma:
            add_tensor(w, f"blk.{i}.post_attention_norm.weight", normal(h, std=0.3), "F32")
            add_tensor(w, f"blk.{i}.post_ffw_norm.weight", normal(h, std=0.3), "F32")
        if v.arch == "phi3":  # q, k and v rows fused into one tensor, as Phi-3's converter writes them
            qkv = np.concatenate([normal(v.heads * d, h, std=2.0 / np.sqrt(h)),
                                  normal(v.kv_heads * d, h, std=2.0 / np.sqrt(h)),
                                  normal(v.kv_heads * d, h, std=1.0 / np.sqrt(h))])
            add_tensor(w, f"blk.{i}.attn_qkv.weight", qkv if v.weights == "F32" else encode(qkv, v.weights),
                       v.weights)
        else:
            linear(f"blk.{i}.attn_q.weight", v.heads * d, h, std=2.0 / np.sqrt(h))
            linear(f"blk.{i}.attn_k.weight", v.kv_heads * d, h, std=2.0 / np.sqrt(h))
            linear(f"blk.{i}.attn_v.weight", v.kv_heads * d, h)
        linear(f"blk.{i}.attn_output.weight", h, v.heads * d)
        if v.bias:
            add_tensor(w, f"blk.{i}.attn_q.bias", normal(v.heads * d, std=0.5), "F32")
            add_tensor(w, f"blk.{i}.attn_k.bias", normal(v.kv_heads * d, std=0.5), "F32")
            add_tensor(w, f"blk.{i}.attn_v.bias", normal(v.kv_heads * d, std=0.5), "F32")
        if v.out_bias:
            add_tensor(w, f"blk.{i}.attn_output.bias", normal(h, std=0.5), "F32")
        if v.arch == "phi3":  # gate and up fused: ffn_up is twice the width, the gate half first
            linear(f"blk.{i}.ffn_up.weight", 2 * v.ffn, h)
        else:
            linear(f"blk.{i}.ffn_gate.weight", v.ffn, h)
            linear(f"blk.{i}.ffn_up.weight", v.ffn, h)
        linear(f"blk.{i}.ffn_down.weight", h, v.ffn)
    finish(w)
    return path

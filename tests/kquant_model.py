"""A tiny llama GGUF whose linears are K-quants (and the other types kvcli reads), written with gguf's
GGUFWriter: 2 layers, hidden 256 (so 256-element super-blocks fit), the bundled model's tokenizer.

Layer 0 is laid out like a Q4_K_M file (Q4_K, with Q6_K for attn_v and ffn_down); layer 1 covers
Q5_K, Q5_0, Q5_1 and Q8_0; the embedding is F16 and tied to the output (a vocabulary-sized
K-quant output would cost seconds to encode). Q4_K / Q6_K come from
kvcli's own encoders (gguf-py has none), Q5_K from random well-formed blocks, the rest from gguf-py's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN, INTER, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2
HEAD_DIM = HIDDEN // HEADS

LAYER_TYPES = [
    {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K",
     "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"},
    {"attn_q": "Q5_K", "attn_k": "Q5_0", "attn_v": "Q5_1", "attn_output": "Q8_0",
     "ffn_gate": "Q5_K", "ffn_up": "Q5_1", "ffn_down": "Q5_0"},
]


def tensor_shapes() -> dict[str, tuple[int, int]]:
    """Layer linear -> [out_features, in_features]."""
    return {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
            "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
            "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN), "ffn_down": (HIDDEN, INTER)}


# Scale and min bytes per 256 weights in kvcli's int8dot form: the file's fp16 scale (and min) per 32,
# or the K-quants' 8-bit multipliers per 32 (scale and min) with an fp16 d and dmin per 256 (Q6_K: 16
# signed multipliers of 16 codes each and one fp16 d).
INT8DOT_GROUP_BYTES = {"Q4_0": 32, "Q4_1": 32, "Q4_K": 20, "Q5_0": 16, "Q5_1": 32, "Q5_K": 20, "Q6_K": 18,
                       "Q8_0": 16}


def cpu_path(type_name: str) -> str:
    """The path the engine's CPU mode takes for a linear of this GGML type."""
    from cpu_paths import cpu_mode

    return cpu_mode("int4-cpu" if type_name in ("Q4_0", "Q4_1", "Q4_K") else "int4x2-cpu")


def kernel_bytes(type_name: str, n: int, k: int, path: str | None = None) -> int:
    """Resident bytes of an [n, k] linear on CPU in the form of `path` (default: cpu_path's): int8dot-cpu
    keeps the file's 4/5/6/8-bit codes, plus INT8DOT_GROUP_BYTES; torch's int4 kernel forms keep
    4-bit codes (int4-cpu) or two nibbles per 5/6/8-bit code (int4x2-cpu), plus a bf16 scale and zero
    per file group."""
    path = path or cpu_path(type_name)
    if path == "int8dot-cpu":
        bits = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6}.get(type_name, 8)
        return n * k * bits // 8 + INT8DOT_GROUP_BYTES[type_name] * n * k // 256
    group = 16 if type_name == "Q6_K" else 32
    code_bytes = n * k // 2 if type_name in ("Q4_0", "Q4_1", "Q4_K") else n * k
    return code_bytes + 4 * n * k // group


def write_tiny_kquant_gguf(path: Path, seed: int = 0, arch: str = "llama", chat_template: str | None = None) -> Path:
    """arch "qwen3" adds per-head q/k norm weights (attn_q_norm / attn_k_norm) to the same layers; "gemma3" also
    norms after attention and MLP, and layer 0 sliding over 8 tokens with layer 1 global; "gemma2" those norms
    and windows without the q/k norms, with attention scores soft-capped at 1 and logits at 5; "qwen2" q/k/v biases.
    chat_template:
    the file's tokenizer.chat_template instead of the bundled model's."""
    import gguf

    from kvcli.model.kquant_encode import add_tensor, copy_fields, encode, finish, open_reader, random_blocks
    from kvcli.model.loader import bundled_gguf_path

    rng = np.random.default_rng(seed)
    src = open_reader(bundled_gguf_path())
    vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-kquant")
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    copy_fields(src, w, keep=lambda key: key.startswith("tokenizer.") and (
        chat_template is None or key != "tokenizer.chat_template"))
    if chat_template is not None:
        w.add_chat_template(chat_template)
    if arch == "gemma3":
        w.add_sliding_window(8)
        w.add_uint32("gemma3.attention.sliding_window_pattern", 2)
        w.add_float32("gemma3.rope.freq_base_swa", 500.0)
    if arch == "gemma2":
        w.add_sliding_window(8)
        w.add_float32("gemma2.attn_logit_softcapping", 1.0)
        w.add_float32("gemma2.final_logit_softcapping", 5.0)

    def normal(*shape: int, std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    add_tensor(w, "token_embd.weight", normal(vocab, HIDDEN, std=0.5).astype(np.float16), "F16")
    add_tensor(w, "output_norm.weight", (1 + normal(HIDDEN, std=0.1)), "F32")
    shapes = tensor_shapes()
    for i, types in enumerate(LAYER_TYPES):
        add_tensor(w, f"blk.{i}.attn_norm.weight", 1 + normal(HIDDEN, std=0.1), "F32")
        add_tensor(w, f"blk.{i}.ffn_norm.weight", 1 + normal(HIDDEN, std=0.1), "F32")
        if arch in ("qwen3", "gemma3"):
            add_tensor(w, f"blk.{i}.attn_q_norm.weight", 1 + normal(HEAD_DIM, std=0.3), "F32")
            add_tensor(w, f"blk.{i}.attn_k_norm.weight", 1 + normal(HEAD_DIM, std=0.3), "F32")
        if arch in ("gemma2", "gemma3"):
            add_tensor(w, f"blk.{i}.post_attention_norm.weight", 1 + normal(HIDDEN, std=0.1), "F32")
            add_tensor(w, f"blk.{i}.post_ffw_norm.weight", 1 + normal(HIDDEN, std=0.1), "F32")
        for name, (n, k) in shapes.items():
            t = types[name]
            std = 1.0 / np.sqrt(k)
            data = random_blocks(t, n, k, rng, scale=std / 4) if t == "Q5_K" else encode(normal(n, k, std=std), t)
            add_tensor(w, f"blk.{i}.{name}.weight", data, t)
        if arch == "qwen2":
            for name, heads in (("attn_q", HEADS), ("attn_k", KV_HEADS), ("attn_v", KV_HEADS)):
                add_tensor(w, f"blk.{i}.{name}.bias", normal(heads * HEAD_DIM, std=0.5), "F32")
    finish(w)
    return path

"""Read a GGUF file's config and tensors (header parsed by kvcli.model.gguf_file; gguf-py for types).

Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K tensors stay quantized (canonical QuantTensor
layouts, lossless); F32 loads as float32, F16 / BF16 stay half precision. Any other GGML type is
refused at load with a one-line error naming the tensor and its type.
llama.cpp stores q/k rows permuted for its rope kernel; they are permuted back to Hugging Face order.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kvcli.config import ModelConfig
from kvcli.model import kquants
from kvcli.model.fused import split_fused
from kvcli.model.gguf_file import GGUFFile, GGUFTensor, read_gguf
from kvcli.model.quant import QuantTensor, from_gguf_q4_0, from_gguf_q4_1, from_gguf_q8_0

# GGML type name -> decoder of its raw blocks (uint8 tensor, rows N, in_features K) into a QuantTensor.
_DECODERS = {
    "Q4_0": from_gguf_q4_0, "Q4_1": from_gguf_q4_1, "Q8_0": from_gguf_q8_0,
    "Q5_0": kquants.from_gguf_q5_0, "Q5_1": kquants.from_gguf_q5_1,
    "Q4_K": kquants.from_gguf_q4_k, "Q5_K": kquants.from_gguf_q5_k, "Q6_K": kquants.from_gguf_q6_k,
}
SUPPORTED_TYPES = ("F32", "F16", "BF16", *_DECODERS)

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Per-architecture layer tensors beyond the llama set.
_ARCH_LAYER_NAMES = {
    # llama.cpp's llama graph adds an attention output bias where the file has one (its other graphs refuse it)
    "llama": {"attn_output.bias": "self_attn.o_proj.bias"},
    "qwen3": {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"},
    # Gemma 3: norms after attention and the MLP (weights already + 1, as llama.cpp's converter writes them).
    "gemma3": {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
               "post_attention_norm.weight": "post_attention_layernorm.weight",
               "ffn_norm.weight": "pre_feedforward_layernorm.weight",
               "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
    # Gemma 2: Gemma 3's norms without the q/k ones.
    "gemma2": {"post_attention_norm.weight": "post_attention_layernorm.weight",
               "ffn_norm.weight": "pre_feedforward_layernorm.weight",
               "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
    # Phi-3: q/k/v fused (or apart), gate and up fused into ffn_up of twice the width (kvcli.model.fused).
    "phi3": {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"},
}
ARCHITECTURES = ("llama", "qwen2", "qwen2vl", "qwen3", "qwen3vl", "phi3", "gemma2", "gemma3")
# llama.cpp's qwen2vl graph (Qwen2-VL / Qwen2.5-VL text models, whose vision tower is a file of its own) is qwen2's
# with M-RoPE: each rotary frequency's angle taken at one of up to four positions (rope.dimension_sections), which
# llama.cpp sets all to the token's position for text, so on text it is qwen2's rotary whatever the sections; its
# qwen3vl graph (Qwen3-VL) is qwen3's the same way, its deepstack layers taking image features only from an image's
# embeddings (n_deepstack_layers: none for text).
ARCH_FAMILY = {"qwen2vl": "qwen2", "qwen3vl": "qwen3"}
# Keys an architecture's llama.cpp graph ignores: attention.sliding_window everywhere but Gemma 3 (llama.cpp's
# llama, qwen2 and qwen3 graphs attend to the whole context whatever it says, and it disables Phi-3's window),
# so those GGUFs attend to the whole context here too (tests/conformance: a window-key variant of each).
_WINDOW_IGNORED = frozenset({"attention.sliding_window"})
ARCH_KEYS_IGNORED = {arch: _WINDOW_IGNORED for arch in ("llama", "qwen2", "qwen2vl", "qwen3", "qwen3vl", "phi3")}
# Keys one architecture's graph reads beyond ARCH_KEYS_READ (read_config's _gemma part).
ARCH_KEYS_EXTRA = {"qwen2vl": frozenset({"rope.dimension_sections"}),
                   "qwen3vl": frozenset({"rope.dimension_sections", "n_deepstack_layers"}),
                   "gemma3": frozenset({"attention.sliding_window_pattern", "rope.freq_base_swa",
                                        "final_logit_softcapping"}),
                   "gemma2": frozenset({"attention.sliding_window_pattern", "rope.freq_base_swa",
                                        "final_logit_softcapping", "attn_logit_softcapping"})}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GGUFError(ValueError):
    pass


# Metadata under "<arch>." that kvcli reads (read_config, _rope_scaling). Any other key under that prefix
# may change what the model computes (soft-capping, experts, per-layer patterns, ...): the file is refused,
# naming it, rather than loaded into a different model.
ARCH_KEYS_READ = frozenset({
    "block_count", "context_length", "embedding_length", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
    "attention.key_length", "attention.value_length", "attention.sliding_window",
    "rope.freq_base", "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor", "rope.scale_linear",
    "rope.scaling.attn_factor", "rope.scaling.original_context_length",
})
# Under "<arch>.", known not to change the computation ("finetuned" is a note).
ARCH_KEYS_INERT = frozenset({"rope.scaling.finetuned"})
# Other namespaces: file description (general.*), the tokenizer (tokenizer.*: read by the tokenizer
# builder), quantization notes (quantize.*: the importance matrix used), split files (checked below).
INERT_NAMESPACES = ("general.", "tokenizer.", "quantize.")
ROPE_SCALINGS = ("none", "linear", "yarn", "longrope")  # llama.cpp's LLAMA_ROPE_SCALING_TYPES
# Rotary tensors: per-pair frequency divisors, read into the config (never weights of a layer).
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
ROPE_FREQS_ARCHS = ("llama",)  # the architectures whose llama.cpp graph creates rope_freqs.weight (Llama 3.1+)
# The architectures whose llama.cpp graph creates rope_factors_long/short.weight (Phi-3's longrope). llama.cpp
# reads them whatever rope.scaling.type says, and llama.cpp's Phi-3 converter writes no type: the tensors,
# rope.scaling.attn_factor and rope.scaling.original_context_length are what make a file longrope.
ROPE_FACTORS_ARCHS = ("llama", "phi3")


def _field(reader: GGUFFile, key: str, default=None):
    return reader.get(key, default)


def _required(reader: GGUFFile, key: str, path: Path):
    v = _field(reader, key)
    if v is None:
        raise GGUFError(f"{path.name}: missing metadata {key}")
    return v


def _check_keys(reader: GGUFFile, arch: str, path: Path) -> None:
    """Every metadata key is read, known inert, or the file is refused in one line naming it."""
    prefix = arch + "."
    for key in reader.metadata:
        if key.startswith(INERT_NAMESPACES):
            continue
        if key.startswith("split."):
            count = _field(reader, "split.count", 1)
            if key == "split.count" and int(count) > 1:
                raise GGUFError(f"{path.name}: one part of a split GGUF ({count} parts): merge the parts first "
                                f"(llama.cpp's llama-gguf-split --merge)")
            continue
        rest = key[len(prefix):] if key.startswith(prefix) else None
        if rest in ARCH_KEYS_READ or rest in ARCH_KEYS_INERT or rest in ARCH_KEYS_IGNORED.get(arch, ()) \
                or rest in ARCH_KEYS_EXTRA.get(arch, ()):
            continue
        value = _field(reader, key)
        shown = value if not isinstance(value, (list, tuple)) or len(value) <= 4 else f"[{len(value)} values]"
        raise GGUFError(f"{path.name}: metadata {key} = {shown!r} is not read by kvcli and may change what the "
                        f"model computes; refusing the file rather than computing a different model")


def _positive(value, key: str, path: Path) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise GGUFError(f"{path.name}: {key} must be a positive number (got {value!r})")
    return float(value)


def _rope_tensor(reader: GGUFFile, name: str, half: int, path: Path) -> list[float] | None:
    t = next((t for t in reader.tensors if t.name == name), None)
    if t is None:
        return None
    if getattr(t.tensor_type, "name", "") != "F32" or int(np.prod([int(x) for x in t.shape])) != half:
        raise GGUFError(f"{path.name}: tensor {name} must be F32 with {half} values (one per rotary pair; got "
                        f"{t.tensor_type.name} {list(t.shape)})")
    values = np.asarray(t.data, dtype=np.float32).reshape(-1)
    if not np.all(np.isfinite(values) & (values > 0)):
        raise GGUFError(f"{path.name}: tensor {name} holds values that are not positive finite numbers")
    return [float(v) for v in values]


def _rope_scaling(reader: GGUFFile, a: str, path: Path, head_dim: int, n_ctx: int) -> dict | None:
    """llama.cpp's rotary hyperparameters as a scaling dictionary in transformers' vocabulary (read by
    kvcli.model.rope). As llama.cpp (llama_model::load_hparams, llama_context): the type defaults to
    linear; rope.scaling.factor (or the old rope.scale_linear) gives freq_scale = 1 / factor, ignored
    when the type is none; yarn mixes interpolated and trained frequencies between the correction dims
    of beta_fast 32 / beta_slow 1 (the llama-family graphs read no other beta) over
    rope.scaling.original_context_length (default: the context length), with attention factor
    (0.1 ln(factor) + 1) x rope.scaling.attn_factor; longrope (rope_factors_long/short tensors, with or without
    rope.scaling.type = longrope) divides by rope_factors_long when the context exceeds the original one, else
    rope_factors_short; rope_freqs.weight divides the frequencies of
    every other type; rope.scaling.attn_factor scales cos and sin in every type."""
    kind = _field(reader, f"{a}.rope.scaling.type", "linear")
    if kind not in ROPE_SCALINGS:
        raise GGUFError(f"{path.name}: {a}.rope.scaling.type = {kind!r}: a rotary scaling kvcli does not compute "
                        f"(llama.cpp's: {', '.join(ROPE_SCALINGS)})")
    factor_key = next((k for k in (f"{a}.rope.scaling.factor", f"{a}.rope.scale_linear")
                       if _field(reader, k) not in (None, 0, 0.0)), None)
    factor = 1.0 if factor_key is None or kind == "none" else _positive(_field(reader, factor_key), factor_key, path)
    attn_key = f"{a}.rope.scaling.attn_factor"
    attn = _positive(_field(reader, attn_key, 1.0), attn_key, path)
    orig_key = f"{a}.rope.scaling.original_context_length"
    original = int(_positive(_field(reader, orig_key, n_ctx), orig_key, path))
    half = head_dim // 2
    freqs = _rope_tensor(reader, "rope_freqs.weight", half, path)
    if freqs is not None and a not in ROPE_FREQS_ARCHS:  # llama.cpp refuses such a file (one tensor too many)
        raise GGUFError(f"{path.name}: tensor rope_freqs.weight in a {a} file: llama.cpp's {a} graph has no such "
                        f"tensor (only {', '.join(ROPE_FREQS_ARCHS)} reads it), so the file's meaning is undefined")
    long, short = (_rope_tensor(reader, f"rope_factors_{w}.weight", half, path) for w in ("long", "short"))
    if (long or short) and a not in ROPE_FACTORS_ARCHS:
        raise GGUFError(f"{path.name}: tensors rope_factors_long/short in a {a} file: llama.cpp's {a} graph has no "
                        f"such tensors (only {', '.join(ROPE_FACTORS_ARCHS)} read them), so the file's meaning is "
                        f"undefined")
    out: dict = {}
    if kind == "longrope" or long or short:
        if (long is None) != (short is None) or long is None:
            raise GGUFError(f"{path.name}: longrope needs both tensors rope_factors_long.weight and "
                            f"rope_factors_short.weight (the file has {'one' if long or short else 'neither'})")
        if freqs is not None:  # llama.cpp would take rope_freqs and drop the long/short factors
            raise GGUFError(f"{path.name}: tensor rope_freqs.weight beside rope_factors_long/short: kvcli does not "
                            f"compute that combination")
        if factor != 1.0 or kind == "yarn":
            raise GGUFError(f"{path.name}: {a}.rope.scaling.type = {kind!r} with factor {factor} beside "
                            f"rope_factors_long/short (positions scaled as well as the factors) is not computed "
                            f"by kvcli")
        out = {"rope_type": "longrope", "long_factor": long, "short_factor": short,
               "original_max_position_embeddings": original, "attention_factor": attn}
    elif kind == "yarn" and factor != 1.0:  # factor 1: both frequency sets agree, the attention factor is 1
        out = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
               "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": (0.1 * float(np.log(factor)) + 1.0) * attn}
    elif factor != 1.0:
        out = {"rope_type": "linear", "factor": factor}
    if freqs is not None:
        out.setdefault("rope_type", "default")
        out["freq_factors"] = freqs
    if attn != 1.0 and "attention_factor" not in out:
        out.setdefault("rope_type", "default")
        out["attention_factor"] = attn
    return out or None


def read_config(reader: GGUFFile, path: Path) -> ModelConfig:
    """The model a GGUF file's metadata describes; GGUFError (one line) for one kvcli cannot compute or an
    impossible one (a zero head count, a key of the wrong type)."""
    try:
        return _read_config(reader, path)
    except GGUFError:
        raise
    except (ValueError, TypeError, ZeroDivisionError, OverflowError) as e:
        raise GGUFError(f"{path.name}: {e}") from None


def _read_config(reader: GGUFFile, path: Path) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{path.name}: unsupported architecture {arch!r} (kvcli runs {', '.join(ARCHITECTURES)})")
    a = arch  # the metadata keys' prefix; arch from here on the family kvcli computes
    _check_keys(reader, arch, path)
    if a in ARCH_FAMILY:
        sections = _field(reader, f"{a}.rope.dimension_sections")
        if sections is not None and not (isinstance(sections, (list, tuple)) and len(sections) >= 3 and all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sections) and sum(sections[:3])):
            raise GGUFError(f"{path.name}: {a}.rope.dimension_sections must list three or four non-negative "
                            f"integers, not all zero (got {sections!r})")
        if sections is not None and any(sections[3:]):  # llama.cpp's fourth position is not the token's on text
            raise GGUFError(f"{path.name}: {a}.rope.dimension_sections = {list(sections)!r}: M-RoPE with a fourth "
                            f"section in use is not computed by kvcli")
        arch = ARCH_FAMILY[a]
    heads = int(_required(reader, f"{a}.attention.head_count", path))
    hidden = int(_required(reader, f"{a}.embedding_length", path))
    if heads <= 0:
        raise GGUFError(f"{path.name}: {a}.attention.head_count = {heads}: must be a positive integer")
    n_vocab = _field(reader, f"{a}.vocab_size")
    if n_vocab is None:
        n_vocab = len(_required(reader, "tokenizer.ggml.tokens", path))
    names = {t.name for t in reader.tensors}
    head_dim = _field(reader, f"{a}.attention.key_length") or hidden // heads
    window = None if "attention.sliding_window" in ARCH_KEYS_IGNORED.get(a, ()) else \
        _field(reader, f"{a}.attention.sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise GGUFError(f"{path.name}: {a}.attention.sliding_window must be a non-negative integer (got {window!r})")
    for key in (f"{a}.rope.dimension_count", f"{a}.attention.value_length"):
        got = _field(reader, key)
        if got is not None and int(got) != int(head_dim):  # partial rotary, or V heads of another width
            raise GGUFError(f"{path.name}: {key} = {got} differs from the head dimension {head_dim}: kvcli "
                            f"computes full-width rotary and equal K/V heads only")
    n_ctx = int(_positive(_field(reader, f"{a}.context_length", 4096), f"{a}.context_length", path))
    eog = _end_of_generation(reader)
    extra = {}
    if arch in ("gemma2", "gemma3"):
        extra = _gemma(reader, a, path, hidden, heads, int(head_dim), window, names)
        window = None  # per layer: layer_types + local_window
    return ModelConfig(
        **extra,
        name=str(_field(reader, "general.name", path.stem)),
        architecture=arch,
        vocab_size=int(n_vocab),
        hidden_size=hidden,
        intermediate_size=int(_required(reader, f"{a}.feed_forward_length", path)),
        num_layers=int(_required(reader, f"{a}.block_count", path)),
        num_heads=heads,
        num_kv_heads=int(_field(reader, f"{a}.attention.head_count_kv", heads)),
        head_dim=int(head_dim),
        rope_theta=float(_field(reader, f"{a}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=n_ctx,
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm=arch in ("qwen3", "gemma3"),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(eog),
        rope_scaling=_rope_scaling(reader, a, path, int(head_dim), n_ctx),
        sliding_window=int(window) if window else None,  # 0 = none, as llama.cpp writes it
    )


# Token texts that end generation, as llama.cpp's llama_vocab::load lists them (o200k's <|end|> aside, below).
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
})


def _end_of_generation(reader: GGUFFile) -> list[int]:
    """llama.cpp's end-of-generation set: the FIM pad/rep/sep ids, every token whose text is one of EOG_TEXTS
    (Gemma's <end_of_turn>, ChatML's <|im_end|>, Llama 3's <|eot_id|>, ...), eos, eot and eom; where the
    vocabulary has <|return|> and <|call|> (or <|flush|> and <|calls|>), <|end|> is not one."""
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    by_text = {str(t): i for i, t in enumerate(tokens) if str(t) in EOG_TEXTS}
    ids = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]  # eos first: the eos
    ids += [_field(reader, f"tokenizer.ggml.fim_{k}_token_id") for k in ("pad", "rep", "sep")]
    ids += sorted(by_text.values())
    if ("<|return|>" in by_text and "<|call|>" in by_text) or ("<|flush|>" in by_text and "<|calls|>" in by_text):
        ids = [i for i in ids if i != by_text.get("<|end|>")]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def _gemma(reader: GGUFFile, a: str, path: Path, hidden: int, heads: int, head_dim: int, window: int | None,
           names: set[str]) -> dict:
    """Gemma 3 as llama.cpp's llama_model_gemma3 reads it: with a sliding window, layers slide except every
    sliding_window_pattern-th (default 6; or a per-layer array of bools), the sliding ones with rotary base
    rope.freq_base_swa (default 10,000) and no frequency scaling; embeddings x sqrt(hidden) in fp32; q scaled
    by 1/sqrt(head_dim) (1/sqrt(hidden/heads) for the 62-layer 27B, as llama.cpp decides by layer count);
    final_logit_softcapping when given. Gemma 2 as llama_model_gemma2 reads it: always a window (default
    4,096) on every other layer (pattern 2), the sliding layers' rotary base rope.freq_base_swa (default:
    the global one) with the global scaling; q scaled by 1/sqrt(hidden/heads) for the 46-layer 27B; attention
    and final logits soft-capped (attn_logit_softcapping, default 50; final_logit_softcapping, default 30);
    the output projection is always the embedding (an output.weight tensor: llama.cpp refuses the file)."""
    gemma2 = a == "gemma2"
    layers = int(_required(reader, f"{a}.block_count", path))
    if gemma2:
        if "output.weight" in names:
            raise GGUFError(f"{path.name}: tensor output.weight in a gemma2 file: llama.cpp's gemma2 graph projects "
                            f"with the embedding and has no such tensor")
        window = 4096 if window is None else window
        if window < 1:
            raise GGUFError(f"{path.name}: {a}.attention.sliding_window = {window}: Gemma 2's sliding layers need a "
                            f"positive window")
    window = int(window or 0)
    if window > 0:
        pattern = _field(reader, f"{a}.attention.sliding_window_pattern", 2 if gemma2 else 6)
        if isinstance(pattern, (list, tuple)):
            if len(pattern) != layers:
                raise GGUFError(f"{path.name}: {a}.attention.sliding_window_pattern lists {len(pattern)} layers "
                                f"of {layers}")
            sliding = [bool(x) for x in pattern]
        else:
            n = int(pattern)
            sliding = [n == 0 or i % n < n - 1 for i in range(layers)]
        types = tuple("sliding" if s else "full" for s in sliding)
    else:
        types = ("full",) * layers
    softcap = _field(reader, f"{a}.final_logit_softcapping", 30.0 if gemma2 else None)
    attn_cap = _field(reader, f"{a}.attn_logit_softcapping", 50.0) if gemma2 else None
    for key, cap in (("final_logit_softcapping", softcap), ("attn_logit_softcapping", attn_cap)):
        if cap is not None and (gemma2 or cap != 0):
            _positive(cap, f"{a}.{key}", path)  # llama.cpp's gemma2 graph divides by both
    scale = (hidden // heads) ** -0.5 if layers == (46 if gemma2 else 62) else head_dim ** -0.5
    if gemma2:  # the sliding layers: their own base if the file gives one, the global frequency scaling
        swa_base = _field(reader, f"{a}.rope.freq_base_swa")
        local = dict(local_rope_theta=None if swa_base is None else float(swa_base),
                     local_rope_scaling=_rope_scaling(reader, a, path, head_dim,
                                                      int(_field(reader, f"{a}.context_length", 4096))))
    else:
        # The sliding layers rotate with freq_scale 1 but llama.cpp hands them the same attn_factor as the
        # global ones: rope.scaling.attn_factor scales their cos and sin too (yarn's 0.1 ln(1 / freq_scale)
        # term is 0).
        attn = float(_field(reader, f"{a}.rope.scaling.attn_factor", 1.0) or 1.0)
        local = dict(local_rope_theta=float(_field(reader, f"{a}.rope.freq_base_swa", 10000.0)),
                     local_rope_scaling={"rope_type": "default", "attention_factor": attn} if attn != 1.0 else None)
    return dict(layer_types=types, local_window=window or None, **local,
                embed_scale=float(np.float32(np.sqrt(np.float32(hidden)))), hidden_act="gelu_tanh",
                sandwich_norms=True, query_scale=float(scale), final_logit_softcap=float(softcap) if softcap else None,
                attn_logit_softcap=float(attn_cap) if attn_cap else None)


def _unpermute_index(rows: int, n_head: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation (pairs of rotary halves interleaved)."""
    half = rows // n_head // 2
    # llama.cpp wrote gguf[h, j, s] = hf[h, s, j] (shape [n_head, half, 2] vs [n_head, 2, half]).
    return torch.arange(rows).reshape(n_head, half, 2).transpose(1, 2).reshape(-1)


def _tensor(t: GGUFTensor, path: Path) -> QuantTensor | torch.Tensor:
    import gguf

    qt = t.tensor_type
    name = getattr(qt, "name", str(qt))
    if name not in SUPPORTED_TYPES:
        raise GGUFError(f"{path.name}: tensor {t.name} is {name}, a GGML type kvcli does not read "
                        f"(supported: {', '.join(SUPPORTED_TYPES)})")
    dims = [int(x) for x in t.shape]  # GGUF order: ne0 (in_features) first
    if len(dims) == 1:
        n, k = 1, dims[0]
    else:
        k, n = dims[0], int(np.prod(dims[1:]))
    block = gguf.GGML_QUANT_SIZES[qt][0]
    if k % block:
        raise GGUFError(f"{path.name}: tensor {t.name} ({name}) has {k} columns, not a multiple of its "
                        f"{block}-element blocks")
    raw = torch.from_numpy(np.array(t.data, copy=True))  # the reader hands out a read-only memmap
    if name in _DECODERS:
        return _DECODERS[name](raw, n, k)
    if name == "F32":
        out = raw
    else:  # F16 / BF16 stay half precision; linears upcast them per call, --dequantize once
        out = raw.view(torch.float16 if name == "F16" else torch.bfloat16)
    return out.reshape(k) if len(dims) == 1 else out.reshape(n, k)


def tensor_bytes_by_type(reader: GGUFFile) -> dict[str, tuple[int, int]]:
    """GGML type name -> (tensor count, bytes in the file), for `kvcli inspect`."""
    out: dict[str, tuple[int, int]] = {}
    for t in reader.tensors:
        c, b = out.get(t.tensor_type.name, (0, 0))
        out[t.tensor_type.name] = (c + 1, b + int(t.nbytes))
    return out


def check_layer_tensors(reader: GGUFFile, config: ModelConfig, path: Path) -> None:
    """The layers the header declares (block_count) against the layers its tensors hold (blk.N.*), without
    reading them: what `inspect --no-load` reports must be the model a load would build (which refuses a file
    missing a layer's tensors)."""
    held = {int(t.name.split(".")[1]) for t in reader.tensors
            if t.name.startswith("blk.") and t.name.split(".")[1].isdigit()}
    if held != set(range(config.num_layers)):
        gaps = sorted(set(range(config.num_layers)) - held)
        raise GGUFError(f"{path.name}: incomplete model (block_count says {config.num_layers} layers, its tensors "
                        f"hold {len(held)}" + (f"; none for layer {gaps[0]}" if gaps else "") + ")")


def open_gguf(path: Path) -> GGUFFile:
    try:
        return read_gguf(path)
    except (ValueError, OSError) as e:  # bad magic, truncated header, unreadable file
        raise GGUFError(f"{path}: not a readable GGUF file ({e})") from None


def _unknown_tensor(name: str, arch: str, path: Path) -> str:
    return (f"{path.name}: tensor {name} is not part of the {arch} model kvcli computes; refusing the file "
            f"rather than ignoring it")


def load_gguf(path: Path, reader: GGUFFile | None = None
              ) -> tuple[ModelConfig, dict[str, QuantTensor | torch.Tensor], dict[str, int]]:
    """Returns (config, weights by Hugging Face name, count of tensors per GGML type). `reader`: the
    file's header when the caller already parsed it (the tokenizer reads the same metadata)."""
    reader = reader or open_gguf(path)
    config = read_config(reader, path)
    layer_names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(config.architecture, {})}
    weights: dict[str, QuantTensor | torch.Tensor] = {}
    types: dict[str, int] = {}
    for t in reader.tensors:
        name = t.name
        if name in ROPE_TENSORS:  # read into config.rope_scaling by read_config
            continue
        if name in _TOP_NAMES:
            hf = _TOP_NAMES[name]
        elif name.startswith("blk."):
            _, idx, rest = name.split(".", 2)
            if rest not in layer_names:
                raise GGUFError(_unknown_tensor(name, config.architecture, path))
            hf = f"model.layers.{idx}.{layer_names[rest]}"
        else:
            raise GGUFError(_unknown_tensor(name, config.architecture, path))
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        w = _tensor(t, path)
        if config.architecture == "llama" and (".q_proj." in hf or ".k_proj." in hf):
            n_head = config.num_heads if ".q_proj." in hf else config.num_kv_heads
            rows = w.shape[0]
            idx = _unpermute_index(rows, n_head)
            w = w.rows(idx) if isinstance(w, QuantTensor) else w[idx].contiguous()
        weights[hf] = w
    try:
        split_fused(config, weights, path.name)
    except ValueError as e:
        raise GGUFError(str(e)) from None
    required = ["self_attn.q_proj.weight"] + (["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
                                              if config.qk_norm else []) \
        + (["post_attention_layernorm.weight", "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"]
           if config.sandwich_norms else [])
    missing = [f"model.layers.{i}.{r}" for i in range(config.num_layers) for r in required
               if f"model.layers.{i}.{r}" not in weights]
    if "model.embed_tokens.weight" not in weights or missing:
        raise GGUFError(f"{path.name}: incomplete model (missing tensors"
                        f"{', e.g. ' + missing[0] if missing else ': model.embed_tokens.weight'})")
    return config, weights, types

"""Small configuration dataclasses shared by the loader, engine and CLI."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvcli.kvcache.kv_dtype import KVDtype, kv_dtype_of

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
# config.json model_type -> kvcli architecture
HF_MODEL_TYPES = {**{a: a for a in SUPPORTED_ARCHITECTURES}, "gemma3_text": "gemma3"}


@dataclass(frozen=True)
class ModelConfig:
    name: str
    architecture: str  # llama | mistral | qwen2 | qwen3 | phi3 | gemma2 | gemma3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has a bias on q/k/v
    rope_scaling: dict | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Sliding-window attention: a query at position p sees keys [p - sliding_window + 1, p] in every
    # layer (Mistral); None = full causal attention. Every token's K/V is still stored (the KV
    # arithmetic of plan/inspect is unchanged).
    sliding_window: int | None = None
    # Qwen3, Gemma 3: an RMSNorm over each q and k head (weight [head_dim], shared by the heads) before the rotary.
    qk_norm: bool = False
    # Gemma 3's parts. layer_types: "sliding" or "full" per layer, the sliding ones attending over
    # local_window tokens with their own rotary (local_rope_theta / local_rope_scaling), the full ones over
    # the whole context with rope_theta / rope_scaling; None: every layer as sliding_window says.
    layer_types: tuple[str, ...] | None = None
    local_window: int | None = None
    local_rope_theta: float | None = None
    local_rope_scaling: dict | None = None
    embed_scale: float = 1.0  # embeddings multiplied by it (Gemma: sqrt(hidden))
    hidden_act: str = "silu"  # the MLP's gate: silu (SwiGLU) or gelu_tanh (GeGLU)
    sandwich_norms: bool = False  # RMSNorms after attention and after the MLP too, before each residual add
    query_scale: float | None = None  # attention's scale on q.k; None: head_dim ** -0.5
    final_logit_softcap: float | None = None  # logits = c * tanh(logits / c)
    attn_logit_softcap: float | None = None  # attention scores s = c * tanh(s / c) before the mask (Gemma 2)

    def __post_init__(self) -> None:
        """Shapes a model can have: one line for a config that names an impossible one, not a crash later."""
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                    "head_dim", "max_position_embeddings"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{key} = {v!r}: must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} attention heads do not split into {self.num_kv_heads} KV head groups")
        if not (0 <= self.rms_norm_eps < math.inf and 0 < self.rope_theta < math.inf):  # also refuses nan
            raise ValueError(f"rms_norm_eps = {self.rms_norm_eps!r} / rope_theta = {self.rope_theta!r}: must be finite, "
                             f"eps >= 0 and theta > 0")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of this layer (None: full attention)."""
        if self.layer_types is None:
            return self.sliding_window
        return self.local_window if self.layer_types[layer] == "sliding" else None

    @property
    def attention_scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim ** -0.5

    def kv_bytes_per_token(self, kv_dtype: "torch.dtype | str | KVDtype") -> int:
        """K and V of every layer for one token, quantization scales included."""
        return kv_dtype_of(kv_dtype).bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim)

    def kv_bytes_of_request(self, kv_dtype: "torch.dtype | str | KVDtype", tokens: int,
                            windowed: bool = True) -> int:
        """K and V of a request of `tokens` tokens: every layer holds them all, or (windowed) each sliding
        layer only its window's (Gemma 3's local layers, Mistral's window)."""
        per_layer = kv_dtype_of(kv_dtype).bytes_per_token(1, self.num_kv_heads, self.head_dim)
        return sum(per_layer * (min(tokens, self.layer_window(i) or tokens) if windowed else tokens)
                   for i in range(self.num_layers))

    def layer_linear_macs(self) -> int:
        """Multiply-adds of every layer's linears for one token (q, k, v, o, gate, up, down; the vocabulary
        projection and attention's own products not included)."""
        h = self.hidden_size
        qkv = h * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        return self.num_layers * (qkv + self.num_heads * self.head_dim * h + 3 * h * self.intermediate_size)

    def num_params(self) -> int:
        h, L = self.hidden_size, self.num_layers
        emb = self.vocab_size * h
        return self.layer_linear_macs() + L * 2 * h + emb * (1 if self.tie_word_embeddings else 2) + h

    @staticmethod
    def from_hf_dict(cfg: dict, name: str = "model") -> "ModelConfig":
        """From a Hugging Face config.json dictionary. A missing field or one of the wrong type is a ValueError
        naming it."""
        if not isinstance(cfg, dict):
            raise ValueError(f"expected a JSON object, found {type(cfg).__name__}")
        model_type = cfg.get("model_type") or ""
        if not isinstance(model_type, str):
            raise ValueError(f"model_type = {model_type!r}: expected a string")
        if not model_type:
            raise ValueError(f"no model_type: the file names no architecture (kvcli runs {', '.join(HF_MODEL_TYPES)})")
        model_type = model_type.lower()
        try:
            return ModelConfig._from_hf_fields(cfg, name, model_type)
        except KeyError as e:
            raise ValueError(f"missing field {e.args[0]}") from None
        except (TypeError, ZeroDivisionError, OverflowError) as e:  # int("x"), int(None), a zero head count
            raise ValueError(f"a field has a value of the wrong type or range ({e})") from None

    @staticmethod
    def _from_hf_fields(cfg: dict, name: str, model_type: str) -> "ModelConfig":
        towers = [k for k in ("vision_config", "audio_config") if isinstance(cfg.get(k), dict)]
        if model_type in QWEN_VL and towers == ["vision_config"]:
            cfg = qwen_vl_text_config(cfg, model_type)
            model_type = QWEN_VL[model_type]
        elif model_type in IMAGE_TEXT and isinstance(cfg.get("text_config"), dict) and towers == ["vision_config"]:
            cfg = language_model_config(cfg, model_type)
            model_type = str(cfg.get("model_type") or "").lower()
        elif towers and isinstance(cfg.get("text_config"), dict):
            archs = cfg.get("architectures")
            what = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else model_type
            raise ValueError(
                f"{what} is a multimodal checkpoint (text_config with {' and '.join(towers)}): kvcli runs text-only "
                f"models, and the text model of image-text {', '.join([*IMAGE_TEXT, *QWEN_VL])} folders; give it the "
                "language model alone (llama.cpp's convert_hf_to_gguf.py writes it as a GGUF)")
        arch = HF_MODEL_TYPES.get(model_type)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {model_type!r} (kvcli runs {', '.join(HF_MODEL_TYPES)})"
            )
        _check_hf_keys(cfg, arch)
        if arch in ("gemma2", "gemma3"):
            return _gemma_from_hf(cfg, name, arch)
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        if heads <= 0:
            raise ValueError(f"num_attention_heads = {heads}: must be a positive integer")
        theta, scaling = _hf_rope(cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return ModelConfig(
            name=name,
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rope_theta=theta,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            rope_scaling=scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=_hf_sliding_window(cfg, arch, int(cfg["num_hidden_layers"])),
        )

    def to_hf_dict(self) -> dict:
        """A transformers config.json equivalent (used to build the reference model in tests)."""
        arch_cls = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM"}
        d = {
            "architectures": [arch_cls[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_scaling": self.rope_scaling,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) or None,
        }
        if self.architecture in ("llama", "qwen3"):
            d["attention_bias"] = self.attention_bias
        if self.architecture != "llama":
            d["sliding_window"] = self.sliding_window
        if self.architecture in ("qwen2", "qwen3"):  # they slide only when asked, from max_window_layers on
            d.update(use_sliding_window=self.sliding_window is not None, max_window_layers=0)
        return d


# config.json fields, as transformers reads them for kvcli's architectures. Every field is read (below or by
# the loader), known not to change the computation, or the folder is refused naming it (issue #29).
HF_KEYS_READ = frozenset({
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor",
    "rms_norm_eps", "max_position_embeddings", "original_max_position_embeddings", "tie_word_embeddings",
    "attention_bias", "bos_token_id", "eos_token_id", "sliding_window", "use_sliding_window", "max_window_layers",
    "layer_types", "hidden_act", "mlp_bias", "quantization_config",
})
_GEMMA_KEYS = frozenset({"query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping",
                         "hidden_activation", "sliding_window_pattern", "_sliding_window_pattern",
                         "use_bidirectional_attention"})
HF_KEYS_READ_BY = {"gemma3": _GEMMA_KEYS | {"rope_local_base_freq"}, "gemma2": _GEMMA_KEYS}
# Bookkeeping, training-only (dropout, initialisation) and generation defaults that transformers keeps on
# every config; pretraining_tp splits Llama's matmuls into slices of the same sums.
HF_KEYS_INERT = frozenset({
    "_name_or_path", "_model_name_or_path", "architectures", "auto_map", "chunk_size_feed_forward", "dtype", "torch_dtype", "id2label",
    "label2id", "is_encoder_decoder", "is_decoder", "output_attentions", "output_hidden_states", "problem_type",
    "return_dict", "transformers_version", "use_cache", "initializer_range", "attention_dropout", "embd_pdrop",
    "resid_pdrop", "hidden_dropout", "pad_token_id", "unk_token_id", "sep_token_id", "decoder_start_token_id", "pretraining_tp",
    "torchscript", "pruned_heads", "tie_encoder_decoder", "cross_attention_hidden_size", "add_cross_attention",
    "finetuning_task", "tokenizer_class", "prefix", "task_specific_params", "use_bfloat16", "tf_legacy_loss",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    # what real checkpoints carry besides (SmolLM2's own config, Unsloth's fine-tunes, transformers 4.4x's saves):
    # markers, the attention implementation and cache class transformers picks, training switches, lengths the
    # tokenizer or a trainer used (the context is max_position_embeddings)
    "is_llama_config", "unsloth_version", "unsloth_fixed", "_attn_implementation_autoset", "attn_implementation",
    "_attn_implementation", "cache_implementation", "gradient_checkpointing", "model_max_length", "max_seq_len",
    "rope_interleaved",  # false only: true is refused below
})


def _check_hf_keys(cfg: dict, arch: str) -> None:
    """One line naming the first config.json field kvcli neither reads nor knows to be inert, or a read
    field whose value kvcli does not compute."""
    for key, value in cfg.items():
        if key in HF_KEYS_READ or key in HF_KEYS_INERT or key in HF_KEYS_READ_BY.get(arch, ()):
            continue
        shown = value if not isinstance(value, (list, dict)) or len(value) <= 4 else f"[{len(value)} values]"
        raise ValueError(f"config.json field {key} = {shown!r} is not read by kvcli and may change what the model "
                         f"computes; refusing the folder rather than computing a different model")
    act = cfg.get("hidden_act")
    if arch not in ("gemma2", "gemma3") and act not in (None, "silu", "swish"):
        raise ValueError(f"hidden_act {act!r}: kvcli computes the {arch} MLP with silu (SwiGLU)")
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias = true (biases on the MLP projections) is not computed by kvcli")
    if cfg.get("rope_interleaved"):
        raise ValueError("rope_interleaved = true (rotary over interleaved pairs) is not computed by kvcli")


# transformers' Gemma3TextConfig defaults: a published image-text Gemma 3 (Gemma3ForConditionalGeneration) writes in
# its text_config only what differs from them (gemma-3-4b-it: hidden and MLP sizes, layers, rope_scaling, window).
GEMMA3_TEXT_DEFAULTS = dict(
    vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072,
    rms_norm_eps=1e-6, rope_theta=1_000_000.0, rope_local_base_freq=10000.0, query_pre_attn_scalar=256,
    sliding_window=4096, sliding_window_pattern=6, final_logit_softcapping=None, attn_logit_softcapping=None,
    attention_bias=False, bos_token_id=2, eos_token_id=1, pad_token_id=0, tie_word_embeddings=True)
# What an image-text folder's config holds beside text_config, none of it read for text: the image tokens' ids and
# count, how image features are projected and merged, the vision tower's config (its weights are not loaded).
_IMAGE_TEXT_KEYS = frozenset({"vision_config", "text_config", "architectures", "model_type", "transformers_version",
                              "torch_dtype", "dtype", "eos_token_id", "bos_token_id", "pad_token_id",
                              "tie_word_embeddings", "_name_or_path", "initializer_range", "image_token_index",
                              "image_token_id"})
# model_type -> (its own keys beside those, text_config's defaults or None (every field given), text model types)
IMAGE_TEXT = {
    "gemma3": (frozenset({"boi_token_index", "eoi_token_index", "mm_tokens_per_image"}), GEMMA3_TEXT_DEFAULTS,
               ("gemma3_text",)),
    "llava": (frozenset({"image_seq_length", "multimodal_projector_bias", "projector_hidden_act", "vision_feature_layer",
                         "vision_feature_select_strategy", "ignore_index"}), None, ("llama", "mistral", "qwen2")),
    "mistral3": (frozenset({"multimodal_projector_bias", "projector_hidden_act", "spatial_merge_size",
                            "vision_feature_layer"}), None, ("mistral", "llama")),
    # LLaVA-NeXT: LLaVA's keys and the grid an image is tiled into (its image_newline tensor is not loaded)
    "llava_next": (frozenset({"image_seq_length", "multimodal_projector_bias", "projector_hidden_act",
                              "vision_feature_layer", "vision_feature_select_strategy", "ignore_index",
                              "image_grid_pinpoints", "use_image_newline_parameter"}), None,
                   ("llama", "mistral", "qwen2")),
}


def language_model_config(cfg: dict, model_type: str) -> dict:
    """The text model of an image-text config (Gemma3ForConditionalGeneration, LLaVA(-NeXT), Mistral 3):
    text_config (over Gemma3TextConfig's defaults for Gemma 3, whose published configs write only what differs), with
    the checkpoint's dtype and token ids where text_config lacks them. kvcli runs it on text alone, as transformers
    does for input without images: the same layers, the vision tower and projector not loaded (model/loader.py)."""
    own, defaults, text_types = IMAGE_TEXT[model_type]
    text = _text_config(cfg, model_type, own, defaults)
    if defaults is not None:
        text.setdefault("model_type", text_types[0])
    if str(text.get("model_type", "")).lower() not in text_types:
        raise ValueError(f"an image-text {model_type} folder whose text model is {text.get('model_type')!r}: kvcli "
                         f"runs the text model of {model_type} folders of {', '.join(text_types)}")
    return text


def _text_config(cfg: dict, model_type: str, own: frozenset, defaults: dict | None = None) -> dict:
    """An image-text config's text_config (over `defaults`), with the checkpoint's dtype and token ids where it lacks
    them; a top-level key neither image-text's nor the family's `own` is refused, naming it."""
    extra = sorted(set(cfg) - _IMAGE_TEXT_KEYS - own)
    if extra:
        raise ValueError(f"config.json field {extra[0]} of an image-text {model_type} folder is not read by kvcli and "
                         f"may change what the model computes; refusing the folder rather than computing a different "
                         f"model")
    tc = cfg["text_config"]
    text = {**(defaults or {}), **tc}
    for key in ("torch_dtype", "dtype", "eos_token_id", "bos_token_id", "pad_token_id", "tie_word_embeddings"):
        if key in cfg and key not in tc:
            text[key] = cfg[key]
    return text


# Qwen2-VL / Qwen2.5-VL / Qwen3-VL: the text model is Qwen2's (Qwen3's) but for its rotary, M-RoPE, which takes each
# frequency's angle at one of three positions (time, height, width; mrope_section gives the frequencies of each, in
# runs or, Qwen3-VL's mrope_interleaved, in turn) where Qwen2 takes the token's position. For text all three are the
# token's position (transformers' get_rope_index, llama.cpp's batch), so on text alone M-RoPE is the plain rotary, and
# Qwen3-VL's deepstack adds image features to early layers only where there is an image. Published Qwen2(.5)-VL
# folders hold the text model's fields at the top level beside vision_config, transformers 5 saves them (and Qwen3-VL
# is published) as text_config; the image and video tokens' ids are not read. model_type -> the text model's family.
QWEN_VL = {"qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3"}
_QWEN_VL_KEYS = frozenset({"vision_start_token_id", "vision_end_token_id", "vision_token_id", "image_token_id",
                           "video_token_id"})


def qwen_vl_text_config(cfg: dict, model_type: str) -> dict:
    """A Qwen2-VL / Qwen2.5-VL / Qwen3-VL config's text model as a qwen2 / qwen3 config (QWEN_VL above), its M-RoPE
    checked to cover the rotary's frequencies and dropped."""
    if isinstance(cfg.get("text_config"), dict):  # transformers 5's save
        text = _text_config(cfg, model_type, _QWEN_VL_KEYS)
    else:  # the published form: the text model's fields beside vision_config
        text = {k: v for k, v in cfg.items() if k != "vision_config" and k not in _QWEN_VL_KEYS}
    text["model_type"] = QWEN_VL[model_type]
    for key in ("rope_scaling", "rope_parameters"):
        rope = text.get(key)
        if not isinstance(rope, dict):
            continue
        kind = rope.get("rope_type") or rope.get("type")
        if kind not in ("mrope", "default", None):  # the vision-language attention rotates by its sections alone
            raise ValueError(f"{key} of type {kind!r} in an image-text {model_type} folder is not computed by kvcli")
        if kind != "mrope" and "mrope_section" not in rope:
            continue
        section = rope.get("mrope_section")
        heads = int(text["num_attention_heads"])
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
        if not (isinstance(section, list) and all(isinstance(n, int) and n >= 0 for n in section)
                and 2 * sum(section) == head_dim):
            raise ValueError(f"{key}: mrope_section {section!r} does not split the rotary's {head_dim // 2} "
                             f"frequencies (head_dim {head_dim})")
        rest = {k: v for k, v in rope.items() if k not in ("rope_type", "type", "mrope_section", "mrope_interleaved")}
        if key == "rope_parameters":  # transformers 5: theta beside the type
            text[key] = {**rest, "rope_type": "default"}
        elif rest:
            raise ValueError(f"rope_scaling {rope!r}: M-RoPE with other scaling is not computed by kvcli")
        else:
            text[key] = None
    return text


def _in_checkpoint_dtype(x: float, cfg: dict) -> float:
    """x rounded to the checkpoint's dtype, as transformers casts Gemma's embedding scale to the weights'."""
    name = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32").replace("torch.", "")
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(name, torch.float32)
    return float(torch.tensor(x, dtype=dtype))


def _gemma_from_hf(cfg: dict, name: str, arch: str) -> "ModelConfig":
    """Gemma 3's text model (model_type gemma3_text) and Gemma 2, as transformers' Gemma3TextConfig and
    Gemma2Config read config.json: layer_types (else every sliding_window_pattern-th layer full, the rest
    sliding: 6 for Gemma 3, 2 for Gemma 2), rotary per layer type for Gemma 3 (rope_parameters
    {full_attention, sliding_attention}, or transformers 4's rope_theta + rope_scaling for the full layers
    and rope_local_base_freq for the sliding ones; Gemma 2: one rotary), query_pre_attn_scalar, attention
    logit soft-capping (Gemma 2's default 50), GeGLU, sandwich norms (their weights get the +1 of GemmaRMSNorm
    at load), q/k norms (Gemma 3), embeddings times sqrt(hidden)."""
    gemma2 = arch == "gemma2"
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"use_bidirectional_attention = {cfg['use_bidirectional_attention']!r}: bidirectional "
                         f"attention is not computed by kvcli")
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        pattern = int(cfg.get("sliding_window_pattern", 2 if gemma2 else 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types must list sliding_attention / full_attention for each of the {layers} layers")
    params = cfg.get("rope_parameters")
    if gemma2:
        full, local = _hf_rope({**cfg, "rope_theta": cfg.get("rope_theta", 10000.0)}), (None, None)
    elif isinstance(params, dict) and "full_attention" in params:
        full, local = _hf_rope({"rope_parameters": params["full_attention"]}), \
            _hf_rope({"rope_parameters": params.get("sliding_attention") or {"rope_theta": 10000.0}})
    else:
        full = _hf_rope({**cfg, "rope_theta": cfg.get("rope_theta", 1_000_000.0)})
        local = (float(cfg.get("rope_local_base_freq", 10000.0)), None)
    window = cfg.get("sliding_window", 4096 if gemma2 else None)
    if "sliding_attention" in types and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding_window must be a positive integer for the sliding layers (got {window!r})")
    heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"hidden_activation {act!r} is not computed by kvcli for {arch} (gelu_pytorch_tanh)")
    eos = cfg.get("eos_token_id", 1)
    softcap = cfg.get("final_logit_softcapping", 30.0 if gemma2 else None)
    attn_cap = cfg.get("attn_logit_softcapping", 50.0 if gemma2 else None)
    for key, cap in (("final_logit_softcapping", softcap), ("attn_logit_softcapping", attn_cap)):
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap < 0):
            raise ValueError(f"{key} must be a non-negative number or null (got {cap!r})")
    return ModelConfig(
        name=name, architecture=arch, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]), num_layers=layers, num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=int(cfg.get("head_dim") or 256),
        rope_theta=full[0], rope_scaling=full[1], rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 8192 if gemma2 else 131072)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        attention_bias=bool(cfg.get("attention_bias", False)), bos_token_id=cfg.get("bos_token_id", 2),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
        qk_norm=not gemma2, layer_types=tuple("sliding" if t == "sliding_attention" else "full" for t in types),
        local_window=int(window) if "sliding_attention" in types else None, local_rope_theta=local[0],
        local_rope_scaling=local[1], embed_scale=_in_checkpoint_dtype(hidden ** 0.5, cfg), hidden_act="gelu_tanh",
        sandwich_norms=True, query_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        final_logit_softcap=float(softcap) if softcap else None,
        attn_logit_softcap=float(attn_cap) if attn_cap else None)


ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")  # what kvcli/model/rope.py computes


def _hf_rope(cfg: dict) -> tuple[float, dict | None]:
    """rope_theta and the scaling, from transformers 4's top-level `rope_theta` / `rope_scaling` or
    transformers 5's `rope_parameters` (theta and scaling in one dict; per layer type for models whose
    layers differ, refused here). A scaling type kvcli does not compute is refused, never dropped."""
    params = cfg.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict) or "rope_theta" not in params:
            raise ValueError(f"rope_parameters must be one dict with rope_theta (got {params!r}); per-layer-type "
                             f"rotary parameters are not read by kvcli")
        theta, scaling = params["rope_theta"], dict(params)
    else:
        theta, scaling = cfg.get("rope_theta", 10000.0), cfg.get("rope_scaling")
    if scaling is not None:
        kind = scaling.get("rope_type") or scaling.get("type") if isinstance(scaling, dict) else scaling
        if kind not in ROPE_TYPES:
            raise ValueError(f"rope scaling {kind!r} is not computed by kvcli (supported: {', '.join(ROPE_TYPES)})")
        if kind == "default":
            scaling = None
        elif kind in ("longrope", "yarn") and "original_max_position_embeddings" not in scaling \
                and cfg.get("original_max_position_embeddings"):  # Phi-3 keeps it at the top level
            scaling = {**scaling, "original_max_position_embeddings": cfg["original_max_position_embeddings"]}
    partial = cfg.get("partial_rotary_factor")
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"partial_rotary_factor {partial} (rotary on part of each head) is not computed by kvcli")
    return float(theta), scaling


def _hf_sliding_window(cfg: dict, arch: str, num_layers: int) -> int | None:
    """The one window every layer uses, as transformers reads config.json (None = full attention).
    Mistral slides in every layer when `sliding_window` is set; Qwen2 only with `use_sliding_window`,
    and then only layers >= `max_window_layers`; `layer_types` overrides both. A window in some layers
    only is refused (one window per model here), never silently dropped."""
    window = cfg.get("sliding_window")
    if arch == "llama" or window is None:  # transformers' Llama ignores sliding_window
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window must be a positive integer or null (got {window!r})")
    if arch in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):  # transformers drops it then
        return None
    types = cfg.get("layer_types")
    if isinstance(types, list):
        sliding = [t == "sliding_attention" for t in types]
    elif arch in ("qwen2", "qwen3"):
        first = int(cfg.get("max_window_layers", 28))
        sliding = [i >= first for i in range(num_layers)]
    else:
        sliding = [True] * num_layers
    if not any(sliding):
        return None
    if not all(sliding):
        raise ValueError(f"sliding-window attention in {sum(sliding)} of {len(sliding)} layers only "
                         "(per-layer windows) is not supported")
    return window


# Real architectures for `--model dummy:NAME` (random weights, as vLLM's load_format=dummy).
PRESETS: dict[str, dict] = {
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
                         tie_word_embeddings=True),
    "llama-2-7b": dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                       rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=4096),
    "llama-2-13b": dict(model_type="llama", vocab_size=32000, hidden_size=5120, intermediate_size=13824,
                        num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=40,
                        rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=4096),
    "llama-3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=8192),
    "mistral-7b": dict(model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       rope_theta=1000000.0, rms_norm_eps=1e-5, max_position_embeddings=32768),
    "gemma-3-4b": dict(model_type="gemma3_text", vocab_size=262208, hidden_size=2560, intermediate_size=10240,
                       num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                       sliding_window=1024, max_position_embeddings=131072, query_pre_attn_scalar=256,
                       rope_scaling={"rope_type": "linear", "factor": 8.0}, rope_theta=1000000.0,
                       rope_local_base_freq=10000.0),
    "gemma-3-270m": dict(model_type="gemma3_text", vocab_size=262144, hidden_size=640, intermediate_size=2048,
                         num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                         sliding_window=512, max_position_embeddings=32768, query_pre_attn_scalar=256,
                         rope_theta=1000000.0, rope_local_base_freq=10000.0),
    "gemma-2-2b": dict(model_type="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                       num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                       sliding_window=4096, max_position_embeddings=8192, query_pre_attn_scalar=256,
                       attn_logit_softcapping=50.0, final_logit_softcapping=30.0, rope_theta=10000.0),
    "qwen2-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                       num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
                       tie_word_embeddings=True),
}


def read_json_object(path: Path) -> dict:
    """A JSON file holding an object (config.json and its siblings); ValueError (one line, the caller names the
    file) otherwise."""
    try:
        obj = json.loads(path.read_text())
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, found {type(obj).__name__}")
    return obj


def preset_config(spec: str) -> ModelConfig:
    """`NAME` from PRESETS or a path to a config.json."""
    if spec in PRESETS:
        return ModelConfig.from_hf_dict(PRESETS[spec], name=f"dummy:{spec}")
    path = Path(spec)
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise ValueError(f"no such config file: {spec}")
        try:
            cfg = read_json_object(path)
        except OSError as e:
            raise ValueError(f"cannot read {spec}: {e}") from None
        return ModelConfig.from_hf_dict(cfg, name=f"dummy:{path.name}")
    raise ValueError(f"unknown dummy preset {spec!r}; choose one of {', '.join(PRESETS)} or a config.json path")


MAX_SEED = 2**62  # room for seed + i (sample i of n, turn i of a chat) below torch's 2**63 limit
MAX_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's top_logprobs limit, vLLM's default)


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()  # the output ends before the first of these (kvcli/engine/output_processor.py)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # as vLLM: the output ends after the stop string instead
    n: int = 1  # samples per prompt; they share the prompt's KV blocks (copy-on-write)
    # Penalties on the logits before sampling, as vLLM and OpenAI define them (kvcli/sampler.py): presence and
    # frequency (-2..2) subtract presence + frequency x count from each token already generated; repetition
    # (> 0, 1 = off; transformers' and llama.cpp's) divides a positive logit of every token of the prompt or
    # the output by it and multiplies a negative one.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Report each sampled token's log probability and this many most likely alternatives (None: no report;
    # 0: the sampled token's only). RequestOutput.logprobs.
    logprobs: int | None = None
    # Also each prompt token's log probability given the tokens before it (the first has none) and this many
    # alternatives (vLLM's prompt_logprobs; OpenAI completions' echo with logprobs). RequestOutput.prompt_logprobs,
    # on the request's first output. Such a request computes its whole prompt (no prefix-cache hit).
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1 (got {self.n})")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0 (got {self.max_tokens})")
        if not 0 <= self.temperature < math.inf:  # also refuses nan
            raise ValueError(f"temperature must be a finite number >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (got {self.top_k})")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:  # torch takes seeds below 2**63
            raise ValueError(f"seed must be in [0, {MAX_SEED}] (got {self.seed})")
        self.stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings (got {self.stop!r})")
        self.stop_token_ids = tuple(self.stop_token_ids)
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:  # also refuses nan
                raise ValueError(f"{name} must be in [-2, 2] (got {getattr(self, name)})")
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (got {self.repetition_penalty})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}] (got {v})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def with_(self, **kw) -> "SamplingParams":
        return replace(self, **kw)


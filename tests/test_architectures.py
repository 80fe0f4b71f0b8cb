"""Architectures beyond Llama (issue #29, item 4), each a tiny random-weight Hugging Face folder saved by
transformers and run through kvcli's paged engine against the same transformers model: teacher-forced
logits in chunks that end mid-block, then decode steps. The GGUF forms are compared with llama.cpp in
tests/conformance."""

from __future__ import annotations

import pytest
import torch

from kvcli.llm import LLM
from kvcli.model.layers import rotary_table_bytes
from engine_steps import teacher_forced

pytestmark = pytest.mark.slow

BASE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
            initializer_range=0.2)


def save_folder(out, gguf_path, model) -> None:
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(str(out))
    model.save_pretrained(str(out))


def gemma_folder(out, gguf_path, model):
    """A Gemma model (built by the caller under seed 0) with its norm weights away from 0 (transformers adds 1, so a
    skipped +1 shows), saved: (folder, model)."""
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)
    save_folder(out, gguf_path, model)
    return out, model


def compare(path, ref, backend: str, n: int = 40) -> float:
    llm = LLM(str(path), quant="none", attention_backend=backend, block_size=8, kv_budget="4MiB",
              max_num_batched_tokens=7)
    ids = list(range(300, 300 + n))
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].float()
    got = teacher_forced(llm.engine, ids, prefill=n - 15, chunk=7)
    return (got - want).abs().max().item() / want.abs().max().item()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, gguf_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = tmp_path_factory.mktemp("qwen3")
    torch.manual_seed(0)
    # head_dim 32 with 4 heads over hidden 64: q/k/v widths differ from the hidden size, as in Qwen3.
    model = Qwen3ForCausalLM(Qwen3Config(**BASE, head_dim=32, rope_theta=1e6, attn_implementation="eager")).eval()
    with torch.no_grad():  # norms away from 1, so a skipped q/k norm shows
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 2.0)
            layer.self_attn.k_norm.weight.uniform_(0.5, 2.0)
    save_folder(out, gguf_path, model)
    return out, model


@pytest.mark.parametrize("backend", ["torch", "invariant"])
def test_qwen3_matches_transformers(qwen3, backend):
    path, ref = qwen3
    assert compare(path, ref, backend) < 1e-4


def test_qwen3_without_its_qk_norms_is_caught(qwen3):
    """The comparison has teeth: the same engine with the q/k norms dropped is far off."""
    from kvcli.model import llama

    path, ref = qwen3
    saved = llama.LlamaModel._qk_norm
    llama.LlamaModel._qk_norm = lambda self, qkv, layer: None
    try:
        assert compare(path, ref, "torch") > 1e-2
    finally:
        llama.LlamaModel._qk_norm = saved


def phi3_folder(out, gguf_path, max_positions: int):
    """A tiny random Phi-3 (fused qkv_proj and gate_up_proj) with longrope factors over an original context of
    64 positions."""
    from transformers import Phi3Config, Phi3ForCausalLM

    half = 8  # head_dim 16
    g = torch.Generator().manual_seed(3)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
            "long_factor": (1 + 8 * torch.rand(half, generator=g)).tolist(),
            "short_factor": (1 + torch.rand(half, generator=g)).tolist()}
    cfg = Phi3Config(**{**BASE, "max_position_embeddings": max_positions}, original_max_position_embeddings=64,
                     rope_parameters=rope, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                     attn_implementation="eager")
    torch.manual_seed(0)
    model = Phi3ForCausalLM(cfg).eval()
    save_folder(out, gguf_path, model)
    return out, model


@pytest.mark.parametrize("max_positions", [512, 64], ids=["long-factors", "short-factors"])
def test_phi3_matches_transformers(tmp_path, gguf_path, max_positions):
    """Past the original context (80 tokens over 64) transformers takes the long factors, as kvcli does for a
    model whose context exceeds the original one; a model of the original context takes the short ones."""
    path, ref = phi3_folder(tmp_path, gguf_path, max_positions)
    llm_config = LLM(str(path), quant="none", kv_budget="4MiB").engine.config
    assert llm_config.architecture == "phi3" and llm_config.rope_scaling["rope_type"] == "longrope"
    n = 80 if max_positions > 64 else 60
    assert compare(path, ref, "torch", n=n) < 1e-4


@pytest.fixture(scope="module")
def gemma3(gemma3_folder):
    return gemma3_folder  # (conftest.py: tests/test_kv_groups.py runs it too)


@pytest.mark.parametrize("backend", ["torch", "invariant"])
def test_gemma3_matches_transformers(gemma3, backend):
    path, ref = gemma3
    engine = LLM(str(path), quant="none", kv_budget="4MiB").engine
    c = engine.config
    assert c.architecture == "gemma3" and c.layer_types == ("sliding",) * 5 + ("full",)
    # plan's and inspect's count of the rotary tables before loading: the local layers' own pair included
    assert c.local_rope_theta is not None and engine.model.table_bytes() == rotary_table_bytes(c)
    assert c.local_window == 8 and c.sliding_window is None
    assert compare(path, ref, backend) < 1e-4  # 40 tokens: the sliding layers drop keys from position 8 on


@pytest.fixture(scope="module")
def gemma3_image_text(tmp_path_factory, gguf_path):
    """A tiny random image-text Gemma 3 (Gemma3ForConditionalGeneration, as Gemma 3 4B and up are published): the
    text model of the gemma3 fixture beside a one-layer SigLIP tower and its projector."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    out = tmp_path_factory.mktemp("gemma3-image-text")
    text = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, head_dim=16, sliding_window=8,
                query_pre_attn_scalar=24, rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                              "rope_theta": 1e6},
                                                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=49151,
                       boi_token_index=49149, eoi_token_index=49150, attn_implementation="eager")
    torch.manual_seed(0)
    return gemma_folder(out, gguf_path, Gemma3ForConditionalGeneration(cfg))


@pytest.mark.parametrize("backend", ["torch", "invariant"])
def test_an_image_text_gemma3_runs_its_text_model(gemma3_image_text, backend):
    """Its language model's tensors are read under their text-model names and the vision tower is not loaded;
    on text the logits are transformers' Gemma3ForConditionalGeneration's."""
    path, ref = gemma3_image_text
    engine = LLM(str(path), quant="none", kv_budget="4MiB").engine
    c = engine.config
    assert c.architecture == "gemma3" and c.layer_types == ("sliding",) * 5 + ("full",) and c.local_window == 8
    assert compare(path, ref, backend) < 1e-4
    if backend == "torch":  # inspect counts the image model's tensors apart, outside the file's weights
        import json

        from typer.testing import CliRunner

        from kvcli.cli import app

        r = CliRunner().invoke(app, ["inspect", str(path), "--json", "--no-load"])
        assert r.exit_code == 0, r.output
        d = json.loads(r.stdout)
        kinds = {g["type"]: g for g in d["tensors"]}
        assert kinds["not loaded (the image model)"]["count"] > 0
        assert d["file_tensor_bytes"] == kinds["F32"]["bytes"] == sum(
            p.numel() * 4 for n, p in ref.named_parameters() if "language_model" in n)


def test_an_image_text_gemma3_config_takes_transformers_defaults(tmp_path):
    """A published image-text config writes in text_config only what differs from Gemma3TextConfig's defaults
    (gemma-3-4b-it's, below): kvcli reads the rest as transformers does."""
    import json

    from transformers import Gemma3Config

    from kvcli.model.loader import load_config

    text = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}
    cfg = {"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
           "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
           "model_type": "gemma3", "text_config": text, "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
           "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                             "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                             "patch_size": 14, "vision_use_head": False}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    c = load_config(str(tmp_path))
    t = Gemma3Config(**{k: v for k, v in cfg.items() if k != "architectures"}).text_config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) \
        == (t.vocab_size, t.hidden_size, t.intermediate_size, t.num_hidden_layers, t.num_attention_heads,
            t.num_key_value_heads, t.head_dim)
    assert c.max_position_embeddings == t.max_position_embeddings and c.local_window == t.sliding_window
    assert c.layer_types == tuple("sliding" if x == "sliding_attention" else "full" for x in t.layer_types)
    full, local = t.rope_parameters["full_attention"], t.rope_parameters["sliding_attention"]
    assert c.rope_theta == full["rope_theta"] and c.rope_scaling["factor"] == 8.0
    assert c.local_rope_theta == local["rope_theta"] and c.query_scale == t.query_pre_attn_scalar ** -0.5
    assert c.eos_token_ids == (1, 106) and c.tie_word_embeddings


def image_text_folder(out, gguf_path, kind: str):
    """A tiny random LLaVA or LLaVA-NeXT (llama text model, CLIP tower; NeXT: its image grid and newline tensor) or
    Mistral 3 (mistral text model with head_dim unlike hidden / heads, Pixtral tower), saved by transformers."""
    import transformers

    clip = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, image_size=28, patch_size=14)
    if kind in ("llava", "llava_next"):
        name = "Llava" if kind == "llava" else "LlavaNext"
        extra = {} if kind == "llava" else {"image_grid_pinpoints": [[28, 28], [28, 56]]}
        cfg = getattr(transformers, f"{name}Config")(text_config={**BASE, "model_type": "llama"}, vision_config=clip,
                                                     image_token_index=49151, **extra)
        cls = getattr(transformers, f"{name}ForConditionalGeneration")
    else:
        cfg = transformers.Mistral3Config(
            text_config={**BASE, "model_type": "mistral", "head_dim": 32, "sliding_window": None},
            image_token_index=49151,
            vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64, head_dim=16,
                               num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14))
        cls = transformers.Mistral3ForConditionalGeneration
    torch.manual_seed(0)
    model = cls(cfg).eval()
    save_folder(out, gguf_path, model)
    return out, model


@pytest.mark.parametrize("kind", ["llava", "llava_next", "mistral3"])
def test_an_image_text_llava_or_mistral3_runs_its_text_model(tmp_path, gguf_path, kind):
    path, ref = image_text_folder(tmp_path, gguf_path, kind)
    c = LLM(str(path), quant="none", kv_budget="4MiB").engine.config
    assert c.architecture == ("mistral" if kind == "mistral3" else "llama") and c.num_layers == 2
    assert compare(path, ref, "torch") < 1e-4


def test_gemma3_with_every_layer_global_is_caught(gemma3):
    """The comparison has teeth: the same engine with the windows ignored is far off past the window."""
    from dataclasses import replace

    from kvcli.model import llama

    path, ref = gemma3
    saved = llama.LlamaModel.__init__

    def no_windows(self, config, *a, **kw):
        saved(self, replace(config, layer_types=("full",) * config.num_layers), *a, **kw)

    llama.LlamaModel.__init__ = no_windows
    try:
        assert compare(path, ref, "torch") > 1e-2
    finally:
        llama.LlamaModel.__init__ = saved


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory, gguf_path):
    """A tiny random Gemma 2: 4 layers alternating sliding (window 8) and global, attention logits soft-capped
    at 2 and final logits at 5 (small enough to bend these random scores), query_pre_attn_scalar unlike
    head_dim, sandwich norms away from 0, GeGLU, tied embeddings scaled by sqrt(hidden)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    out = tmp_path_factory.mktemp("gemma2")
    cfg = Gemma2Config(**{**BASE, "num_hidden_layers": 4, "tie_word_embeddings": True}, head_dim=16,
                       sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                       final_logit_softcapping=5.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                       attn_implementation="eager")
    torch.manual_seed(0)
    return gemma_folder(out, gguf_path, Gemma2ForCausalLM(cfg))


@pytest.mark.parametrize("backend", ["torch", "invariant"])
def test_gemma2_matches_transformers(gemma2, backend):
    path, ref = gemma2
    c = LLM(str(path), quant="none", kv_budget="4MiB").engine.config
    assert c.architecture == "gemma2" and c.layer_types == ("sliding", "full") * 2 and not c.qk_norm
    assert c.attn_logit_softcap == 2.0 and c.final_logit_softcap == 5.0 and c.local_rope_theta is None
    assert compare(path, ref, backend) < 1e-4


def test_gemma2_without_its_attention_softcap_is_caught(gemma2):
    """The comparison has teeth: the same engine without the attention soft-cap is far off."""
    from dataclasses import replace

    from kvcli.model import llama

    path, ref = gemma2
    saved = llama.LlamaModel.__init__

    def uncapped(self, config, *a, **kw):
        saved(self, replace(config, attn_logit_softcap=None), *a, **kw)

    llama.LlamaModel.__init__ = uncapped
    try:
        assert compare(path, ref, "torch") > 1e-2
    finally:
        llama.LlamaModel.__init__ = saved


def test_inspect_counts_what_gemma3_windows_would_hold(tmp_path):
    """inspect: the layer kinds, and a request's KV as the paged layout holds it (per-group block tables: the
    windowed layers their window's blocks) against every layer every token and the windows' tokens alone;
    dummy: weights of the shape run through the engine."""
    import json

    from typer.testing import CliRunner

    from kvcli.cli import app

    cfg = dict(model_type="gemma3_text", vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
               num_attention_heads=2, num_key_value_heads=1, head_dim=64, sliding_window=32,
               max_position_embeddings=4096)
    (tmp_path / "g3.json").write_text(json.dumps(cfg))
    r = CliRunner().invoke(app, ["inspect", f"dummy:{tmp_path / 'g3.json'}", "--context", "1024", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output)
    per_layer_token = 2 * 1 * 64 * 2  # K and V, one KV head of 64, fp16
    assert rep["layer_kinds"] == "5 sliding (window 32) and 1 global of 6 layers"
    # The paged layout's per-group tables: the global layer every block, each windowed layer at most
    # ceil((W - 1 + 512-token steps) / 16) + 1 = 35 blocks.
    assert rep["kv_request_held"] == (1024 + 5 * 35 * 16) * per_layer_token
    assert rep["kv_request_every"] == 6 * 1024 * per_layer_token
    assert rep["kv_groups"].startswith("6 block tables per request, 1 layer each")
    assert rep["kv_request_windowed"] == (5 * 32 + 1024) * per_layer_token
    assert any(how.startswith("yes") for what, how in rep["weight_plan"] if what == "one-call decode")


def qwen_vl_folder(out, gguf_path, kind: str, layout: str):
    """A tiny random Qwen2-VL or Qwen2.5-VL as transformers 5 saves it (text_config; model.* and visual.*), rewritten
    as the published folders hold it (the text model's fields at the top level beside vision_config, rope_scaling of
    type mrope) or with transformers 4.52-4.57's tensor names (model.language_model.*, model.visual.*). Its M-RoPE
    sections split the 8 frequencies of head_dim 16."""
    import json

    import transformers
    from safetensors.torch import load_file, save_file

    text = {**BASE, "rope_parameters": {"rope_type": "mrope", "mrope_section": [2, 3, 3], "rope_theta": 1e6}}
    if kind == "qwen3_vl":  # Qwen3's text model (q/k norms, no biases), M-RoPE interleaved, deepstack in the tower
        text = {**BASE, "head_dim": 16, "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                                           "mrope_interleaved": True, "rope_theta": 1e6}}
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      deepstack_visual_indexes=[0])
        cfg, cls = transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration
    elif kind == "qwen2_5_vl":
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      fullatt_block_indexes=[0])
        cfg, cls = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
    else:
        vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2)
        cfg, cls = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
    torch.manual_seed(0)
    model = cls(cfg(text_config=text, vision_config=vision)).eval()
    with torch.no_grad():  # q/k/v biases away from 0 (Qwen3: q/k norms away from 1), so a dropped one shows
        for layer in model.model.language_model.layers:
            if kind == "qwen3_vl":
                layer.self_attn.q_norm.weight.uniform_(0.5, 2.0)
                layer.self_attn.k_norm.weight.uniform_(0.5, 2.0)
                continue
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.uniform_(-0.5, 0.5)
    save_folder(out, gguf_path, model)
    if layout == "published":
        saved = json.loads((out / "config.json").read_text())
        flat = {k: v for k, v in saved.items() if k != "text_config"}
        flat.update({k: v for k, v in saved["text_config"].items() if k not in ("model_type", "rope_parameters")})
        flat.update(rope_theta=1e6, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
        (out / "config.json").write_text(json.dumps(flat))
    elif layout == "language_model":
        for f in out.glob("*.safetensors"):
            tensors = load_file(str(f))
            assert any(k.startswith("visual.") for k in tensors) and any(k.startswith("model.layers.") for k in tensors)
            save_file({("model." + k if k.startswith("visual.") else k.replace("model.", "model.language_model.", 1)
                        if k.startswith("model.") else k): v for k, v in tensors.items()}, str(f),
                      metadata={"format": "pt"})
    return out, model


@pytest.mark.parametrize("kind, layout", [(k, lay) for k in ("qwen2_vl", "qwen2_5_vl")
                                          for lay in ("transformers5", "published", "language_model")]
                         + [("qwen3_vl", "transformers5")])
def test_a_qwen_vl_folder_runs_its_text_model(tmp_path, gguf_path, kind, layout):
    """On text, M-RoPE's three positions are the token's: the text model is Qwen2 (q/k/v biases, its rotary), in each
    layout such folders come in; the vision tower is not loaded."""
    import json

    path, ref = qwen_vl_folder(tmp_path, gguf_path, kind, layout)
    assert ("text_config" in json.loads((path / "config.json").read_text())) is (layout != "published")
    c = LLM(str(path), quant="none", kv_budget="4MiB").engine.config
    qwen3 = kind == "qwen3_vl"
    assert c.architecture == ("qwen3" if qwen3 else "qwen2") and c.num_layers == 2 and c.rope_scaling is None
    assert c.attention_bias is not qwen3 and c.qk_norm is qwen3
    assert c.rope_theta == 1e6
    assert compare(path, ref, "torch") < 1e-4


def test_llama_attention_bias_reads_every_bias_and_an_unread_tensor_is_refused(tmp_path, gguf_path):
    """transformers' Llama under attention_bias gives q/k/v and o_proj a bias: all four are computed (the o bias was
    once left unread, 0.55 relative error); a tensor the model does not read is refused in one line, naming it."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvcli.options import ConfigError

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**BASE, attention_bias=True, attn_implementation="eager")).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                         layer.self_attn.o_proj):
                proj.bias.uniform_(-0.5, 0.5)
    save_folder(tmp_path, gguf_path, model)
    assert compare(tmp_path, model, "torch") < 1e-4
    f = tmp_path / "model.safetensors"
    tensors = load_file(str(f))
    tensors["model.layers.1.mlp.down_proj.lora_B.weight"] = torch.zeros(64, 4)
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="tensor model.layers.1.mlp.down_proj.lora_B.weight .1 not read in all. is "
                                          "not read by kvcli") as e:
        LLM(str(tmp_path), quant="none", kv_budget="4MiB")
    assert "\n" not in str(e.value)

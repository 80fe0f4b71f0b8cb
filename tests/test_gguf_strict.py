"""Nothing in a GGUF is silently skipped (issue #29, item 2, the GGUF side): every metadata key is read, known
inert, or the file is refused in one line naming it; every tensor is used or the file is refused; a rotary
scaling is read as llama.cpp reads it (or refused when llama.cpp knows no such type); generation stops on llama.cpp's
end-of-generation set. Variants of the tiny K-quant GGUF (tests/kquant_model.py) differ in one piece each.
The transformers-5 config layout (`rope_parameters`) is read, and unknown rotary types refused."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kvcli.config import ModelConfig
from kvcli.model.gguf_loader import GGUFError, load_gguf, open_gguf, read_config


def variant(src, dst, extra: dict | None = None, drop: tuple[str, ...] = (), tensor: tuple | None = None):
    """A copy of the GGUF `src` with metadata `extra` added ({key: (value, GGUFValueType)}), keys `drop` left
    out and, optionally, one more tensor (name, float32 array)."""
    import gguf

    from kvcli.model.kquant_encode import add_tensor, copy_fields, finish, open_reader

    reader = open_reader(src)
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    copy_fields(reader, writer, keep=lambda key: key not in drop and key not in (extra or {}))
    for key, (value, vtype) in (extra or {}).items():
        writer.add_key_value(key, value, vtype)
    for t in reader.tensors:
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        data = np.array(t.data)
        if t.tensor_type.name not in ("F32", "F16"):
            data = data.reshape(shape[0] if len(shape) > 1 else 1, -1)
        add_tensor(writer, t.name, data, t.tensor_type.name)
    if tensor is not None:
        add_tensor(writer, tensor[0], tensor[1], "F32")
    finish(writer)
    return dst


def config_of(path) -> ModelConfig:
    return read_config(open_gguf(path), path)


@pytest.fixture(scope="module")
def base(tiny_kquant):
    return tiny_kquant


def test_the_plain_file_loads_and_an_unknown_key_is_refused_naming_it(base, tmp_path):
    import gguf

    V = gguf.GGUFValueType
    assert config_of(base).rope_scaling is None
    for key, value, vtype in [("llama.attention.logit_softcapping", 30.0, V.FLOAT32),
                              ("llama.expert_count", 8, V.UINT32),
                              ("someother.block_count", 2, V.UINT32)]:
        path = variant(base, tmp_path / f"{key}.gguf", {key: (value, vtype)})
        with pytest.raises(GGUFError, match=f"metadata {key} = "):
            config_of(path)


def test_an_impossible_shape_is_refused_in_one_line(base, tmp_path):
    """A head count of 0, or heads that do not split into the KV heads: a GGUFError naming it, not a division by
    zero or a model that crashes later."""
    import gguf

    V = gguf.GGUFValueType
    arch = config_of(base).architecture
    for key, value, needle in [(f"{arch}.attention.head_count", 0, "head_count = 0: must be a positive"),
                               (f"{arch}.attention.head_count_kv", 3, "do not split into 3"),
                               (f"{arch}.block_count", 0, "num_layers = 0")]:
        path = variant(base, tmp_path / f"{key}.gguf", {key: (value, V.UINT32)})
        with pytest.raises(GGUFError, match=needle):
            config_of(path)


def test_rotary_scalings_are_read_as_llama_cpp_reads_them(base, tmp_path):
    """Every type llama.cpp knows is read into one scaling dictionary; a type it does not know is refused."""
    import gguf

    V = gguf.GGUFValueType
    n_ctx = config_of(base).max_position_embeddings
    linear = variant(base, tmp_path / "linear.gguf", {"llama.rope.scaling.type": ("linear", V.STRING),
                                                      "llama.rope.scaling.factor": (4.0, V.FLOAT32),
                                                      "llama.rope.scaling.original_context_length": (128, V.UINT32)})
    assert config_of(linear).rope_scaling == {"rope_type": "linear", "factor": 4.0}
    # llama.cpp's default type is linear: a factor without a type scales; "none" ignores the factor.
    untyped = variant(base, tmp_path / "untyped.gguf", {"llama.rope.scaling.factor": (2.0, V.FLOAT32)})
    assert config_of(untyped).rope_scaling == {"rope_type": "linear", "factor": 2.0}
    none = variant(base, tmp_path / "none.gguf", {"llama.rope.scaling.type": ("none", V.STRING),
                                                  "llama.rope.scaling.factor": (4.0, V.FLOAT32)})
    assert config_of(none).rope_scaling is None
    no_factor = variant(base, tmp_path / "nofactor.gguf", {"llama.rope.scaling.type": ("linear", V.STRING)})
    assert config_of(no_factor).rope_scaling is None
    yarn = variant(base, tmp_path / "yarn.gguf", {"llama.rope.scaling.type": ("yarn", V.STRING),
                                                  "llama.rope.scaling.factor": (4.0, V.FLOAT32),
                                                  "llama.rope.scaling.attn_factor": (0.5, V.FLOAT32)})
    got = config_of(yarn).rope_scaling
    assert got["rope_type"] == "yarn" and got["factor"] == 4.0 and got["original_max_position_embeddings"] == n_ctx
    assert got["attention_factor"] == pytest.approx((0.1 * np.log(4.0) + 1) * 0.5)
    unknown = variant(base, tmp_path / "dyn.gguf", {"llama.rope.scaling.type": ("dynamic", V.STRING)})
    with pytest.raises(GGUFError, match="rope.scaling.type = 'dynamic'"):
        config_of(unknown)
    beta = variant(base, tmp_path / "beta.gguf", {"llama.rope.scaling.yarn_beta_fast": (16.0, V.FLOAT32)})
    with pytest.raises(GGUFError, match="metadata llama.rope.scaling.yarn_beta_fast = 16.0"):
        config_of(beta)  # llama.cpp's llama graph does not read it: refused, not guessed


def test_rotary_tensors_are_read_and_checked(base, tmp_path):
    """rope_freqs.weight divides the frequencies (Llama 3.1+); longrope's factors come as a pair, with or without their type; a tensor of the
    wrong length or with non-positive values is one line."""
    import gguf
    import torch

    from kvcli.model.layers import Rotary

    V = gguf.GGUFValueType
    plain = config_of(base)
    half = plain.head_dim // 2
    ff = np.linspace(1.0, 8.0, half).astype(np.float32)
    path = variant(base, tmp_path / "freqs.gguf", tensor=("rope_freqs.weight", ff))
    config, weights, _ = load_gguf(path)
    assert config.rope_scaling == {"rope_type": "default", "freq_factors": pytest.approx(ff.tolist())}
    assert not any("rope" in k for k in weights)
    r = Rotary(config.head_dim, 16, config.rope_theta, config.rope_scaling, torch.device("cpu"))
    inv = 1.0 / (plain.rope_theta ** (torch.arange(0, plain.head_dim, 2).float() / plain.head_dim))
    torch.testing.assert_close(r.cos[9, :half], torch.cos(9 * (inv / torch.from_numpy(ff))))
    bad = variant(base, tmp_path / "short.gguf", tensor=("rope_freqs.weight", np.ones(half - 1, dtype=np.float32)))
    with pytest.raises(GGUFError, match=f"rope_freqs.weight must be F32 with {half} values"):
        config_of(bad)
    zero = variant(base, tmp_path / "zero.gguf", tensor=("rope_freqs.weight", np.zeros(half, dtype=np.float32)))
    with pytest.raises(GGUFError, match="not positive finite"):
        config_of(zero)
    stray = variant(base, tmp_path / "stray.gguf", tensor=("rope_factors_long.weight", ff))
    with pytest.raises(GGUFError, match="longrope needs both tensors .*the file has one"):
        config_of(stray)
    untyped = variant(stray, tmp_path / "untyped.gguf", tensor=("rope_factors_short.weight", ff[::-1].copy()))
    got = config_of(untyped).rope_scaling  # Phi-3's converter writes the tensors and no scaling type
    assert got["rope_type"] == "longrope" and got["short_factor"] == pytest.approx(ff[::-1].tolist())
    yarn = variant(untyped, tmp_path / "yarn.gguf", {"llama.rope.scaling.type": ("yarn", V.STRING),
                                                     "llama.rope.scaling.factor": (4.0, V.FLOAT32)})
    with pytest.raises(GGUFError, match="beside rope_factors_long/short"):
        config_of(yarn)
    lr = tmp_path / "lr-src.gguf"
    variant(base, lr, {"llama.rope.scaling.type": ("longrope", V.STRING),
                       "llama.rope.scaling.original_context_length": (plain.max_position_embeddings // 2, V.UINT32)},
            tensor=("rope_factors_long.weight", ff))
    longrope = variant(lr, tmp_path / "lr.gguf", tensor=("rope_factors_short.weight", ff[::-1].copy()))
    got = config_of(longrope).rope_scaling
    assert got["rope_type"] == "longrope" and got["long_factor"] == pytest.approx(ff.tolist())
    with pytest.raises(GGUFError, match="needs both tensors rope_factors_long.weight and rope_factors_short.weight"):
        config_of(lr)


def test_linear_scaling_divides_the_positions(base, tmp_path):
    """Linear scaling by f rotates position p as the plain file rotates p / f (llama.cpp's freq_scale)."""
    import gguf
    import torch

    from kvcli.model.layers import Rotary

    V = gguf.GGUFValueType
    linear = config_of(variant(base, tmp_path / "lin.gguf", {"llama.rope.scaling.type": ("linear", V.STRING),
                                                             "llama.rope.scaling.factor": (4.0, V.FLOAT32)}))
    plain = config_of(base)
    a = Rotary(linear.head_dim, 64, linear.rope_theta, linear.rope_scaling, torch.device("cpu"))
    b = Rotary(plain.head_dim, 64, plain.rope_theta, plain.rope_scaling, torch.device("cpu"))
    assert not torch.allclose(a.cos[8], b.cos[8])
    half = plain.head_dim // 2
    inv = 1.0 / (plain.rope_theta ** (torch.arange(0, plain.head_dim, 2).float() / plain.head_dim))
    torch.testing.assert_close(a.cos[8, :half], torch.cos(8 / 4 * inv))


def test_partial_rotary_and_unknown_tensors_are_refused(base, tmp_path):
    import gguf

    V = gguf.GGUFValueType
    partial = variant(base, tmp_path / "partial.gguf", {"llama.rope.dimension_count": (32, V.UINT32)})
    with pytest.raises(GGUFError, match="rope.dimension_count = 32 differs from the head dimension 64"):
        config_of(partial)
    extra = variant(base, tmp_path / "extra.gguf", tensor=("blk.0.attn_q_norm.weight", np.ones(64, dtype=np.float32)))
    with pytest.raises(GGUFError, match="tensor blk.0.attn_q_norm.weight is not part of the llama model"):
        load_gguf(extra)
    config, weights, _ = load_gguf(base)  # the plain file: every tensor used
    assert len(weights) == 2 + 9 * config.num_layers


def test_generation_stops_on_the_end_of_generation_set(base, tmp_path):
    import gguf

    V = gguf.GGUFValueType
    reader = open_gguf(base)
    tokens = [str(t) for t in reader.get("tokenizer.ggml.tokens")]
    eos = config_of(base).eos_token_ids
    # eos first, then every token llama.cpp ends on by its text (SmolLM2: <|im_end|> is eos, <|endoftext|> too)
    assert eos[0] == reader.get("tokenizer.ggml.eos_token_id")
    assert set(eos) == {reader.get("tokenizer.ggml.eos_token_id"), tokens.index("<|endoftext|>"),
                        tokens.index("<|im_end|>")}
    path = variant(base, tmp_path / "eot.gguf", {"tokenizer.ggml.eot_token_id": (7, V.UINT32),
                                                 "tokenizer.ggml.eom_token_id": (9, V.UINT32),
                                                 "tokenizer.ggml.fim_pad_token_id": (11, V.UINT32)})
    got = config_of(path).eos_token_ids
    assert got[:3] == (eos[0], 7, 9) and set(got) == {*eos, 7, 9, 11}


def test_the_cli_refuses_in_one_line(base, tmp_path):
    import gguf

    path = variant(base, tmp_path / "cap.gguf", {"llama.final_logit_softcapping": (30.0, gguf.GGUFValueType.FLOAT32)})
    out = subprocess.run([sys.executable, "-c", "from kvcli.cli import main; main()", "inspect", str(path), "--no-load"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert out.stderr.strip().count("\n") == 0 and "llama.final_logit_softcapping" in out.stderr


def test_chat_says_when_the_file_has_no_chat_template(base, tmp_path):
    """Without tokenizer.chat_template, chat sends plain 'role: text' lines, and says so once; with one, no note."""
    path = variant(base, tmp_path / "notmpl.gguf", drop=("tokenizer.chat_template",))
    note = "this model has no chat template"
    for model, expect in ((path, True), (base, False)):
        out = subprocess.run([sys.executable, "-c", "from kvcli.cli import main; main()", "chat", "--model", str(model),
                              "-n", "2"], input="hello\n", capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
        assert out.stderr.count(note) == int(expect), out.stderr


@pytest.mark.slow
def test_serve_says_when_the_file_has_no_chat_template(base, tmp_path):
    """serve says so once as it starts, and its chat endpoint still answers (the plain 'role: text' lines); a file
    with a template gets no note."""
    import httpx
    from test_serve import ServeProcess

    path = variant(base, tmp_path / "notmpl.gguf", drop=("tokenizer.chat_template",))
    note = "this model has no chat template"
    for model, expect in ((path, True), (base, False)):
        s = ServeProcess("--model", str(model), "--kv-budget", "24MiB", "--max-model-len", "256")
        url = s.wait_ready()
        try:
            assert sum(note in line for line in s.lines) == int(expect), "".join(s.lines)
            body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
            r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
        finally:
            assert s.stop() == 0, "".join(s.lines)


HF = dict(model_type="llama", num_attention_heads=4, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
          vocab_size=100)


def test_transformers_5_rope_parameters_are_read():
    """transformers 5 writes rope_theta (and the scaling) inside rope_parameters: read, not defaulted."""
    c = ModelConfig.from_hf_dict({**HF, "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}})
    assert c.rope_theta == 100000.0 and c.rope_scaling is None
    c = ModelConfig.from_hf_dict({**HF, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}})
    assert c.rope_theta == 5e5 and c.rope_scaling["factor"] == 2.0
    assert ModelConfig.from_hf_dict({**HF, "rope_theta": 1e6}).rope_theta == 1e6  # transformers 4's layout
    for bad in ({"rope_scaling": {"rope_type": "proportional", "factor": 4.0}},
                {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
                {"partial_rotary_factor": 0.5}):
        with pytest.raises(ValueError, match="not computed by kvcli"):
            ModelConfig.from_hf_dict({**HF, **bad})


def test_generation_config_eos_list_ends_generation(tmp_path):
    """transformers' generate() stops on generation_config.json's eos_token_id (Llama 3: a list); so does
    kvcli; without that file config.json's id stands."""
    import json

    from kvcli.model.loader import ModelLoadError, load_config

    (tmp_path / "config.json").write_text(json.dumps({**HF, "eos_token_id": 2}))
    assert load_config(str(tmp_path)).eos_token_ids == (2,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    assert load_config(str(tmp_path)).eos_token_ids == (2, 7, 9)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "seven"}))
    with pytest.raises(ModelLoadError, match="eos_token_id must be a token id"):
        load_config(str(tmp_path))


def test_config_json_fields_are_read_inert_or_refused():
    """config.json: a field kvcli does not read and does not know to be inert refuses the folder, naming it;
    transformers' own bookkeeping of every architecture kvcli runs is accepted as transformers writes it."""
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config

    for cls in (LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, Phi3Config, Gemma3TextConfig):
        ModelConfig.from_hf_dict(cls().to_dict())  # every field transformers 5 writes
    for bad, needle in (({"attn_logit_softcapping": 50.0}, "field attn_logit_softcapping = 50.0"),
                        ({"query_pre_attn_scalar": 144}, "field query_pre_attn_scalar = 144"),
                        ({"embedding_multiplier": 12.0}, "field embedding_multiplier"),
                        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
                        ({"mlp_bias": True}, "mlp_bias")):
        with pytest.raises(ValueError, match=needle):
            ModelConfig.from_hf_dict({**HF, **bad})
    ModelConfig.from_hf_dict({**HF, "hidden_act": "silu", "mlp_bias": False, "pretraining_tp": 1})


def test_the_context_length_is_checked_and_bounds_nothing_it_need_not(base, tmp_path):
    """A context_length of 0 is refused naming that key (the message once named a rope key the file lacks); one of
    2^32 - 1 tokens is refused at load in one line naming --max-model-len (its rotary tables were built for every
    position: a 2 TiB allocation and a traceback), and with --max-model-len the model loads, its tables that long."""
    import gguf

    from kvcli.config import SamplingParams
    from kvcli.engine.llm_engine import LLMEngine
    from kvcli.model.loader import load_weights
    from kvcli.options import ConfigError, EngineOptions

    V = gguf.GGUFValueType
    arch = config_of(base).architecture
    zero = variant(base, tmp_path / "ctx0.gguf", {f"{arch}.context_length": (0, V.UINT32)})
    with pytest.raises(GGUFError, match=f"{arch}.context_length must be a positive number"):
        config_of(zero)
    huge = variant(base, tmp_path / "ctxhuge.gguf", {f"{arch}.context_length": (2**32 - 1, V.UINT32)})
    with pytest.raises(ConfigError, match=r"4,294,967,295-token context needs .* GiB of rotary tables.*"
                                          r"--max-model-len"):
        LLMEngine(load_weights(str(huge)), EngineOptions(kv_budget="16MiB"))
    engine = LLMEngine(load_weights(str(huge)), EngineOptions(kv_budget="16MiB", max_model_len=300))
    assert engine.max_model_len == 300 and engine.model.rotary.cos.shape[0] == 300
    req = engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert len(req.output_token_ids) == 3


def test_inspect_without_loading_refuses_layers_the_tensors_do_not_hold(base, tmp_path):
    """block_count past the file's blk.N tensors: `inspect --no-load` once reported the declared model and its KV
    figures; it now refuses the file in one line, as a load does."""
    import gguf

    arch = config_of(base).architecture
    n = config_of(base).num_layers
    path = variant(base, tmp_path / "blk.gguf", {f"{arch}.block_count": (n + 7, gguf.GGUFValueType.UINT32)})
    cli = [sys.executable, "-c", "from kvcli.cli import main; main()", "inspect"]
    out = subprocess.run([*cli, str(path), "--no-load"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert out.stderr.strip().count("\n") == 0, out.stderr
    assert f"block_count says {n + 7} layers, its tensors hold {n}; none for layer {n}" in out.stderr, out.stderr
    ok = subprocess.run([*cli, str(base), "--no-load"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr


def test_a_qwen2vl_file_is_qwen2_on_text_and_its_sections_are_checked(tmp_path):
    """llama.cpp's qwen2vl files (Qwen2-VL / Qwen2.5-VL text models) run as qwen2: on text M-RoPE's positions are the
    token's in its first three sections (tests/conformance compares logits with llama.cpp); sections that are not
    a list of counts, or a fourth section in use (its position is not the token's in llama.cpp), are refused in one
    line."""
    from dataclasses import replace
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).with_name("conformance")))
    from tiny_gguf import BY_NAME, write

    v = BY_NAME["qwen2vl"]
    c = config_of(write(v, tmp_path / "ok.gguf"))
    assert c.architecture == "qwen2" and c.attention_bias and c.rope_theta == 1e6 and c.rope_scaling is None
    for sections, needle in [([2, 3, 3, 1], "a fourth section in use"), ([0, 0, 0, 0], "not all zero"),
                             ([4, 4], "three or four")]:
        path = write(replace(v, meta={"rope.dimension_sections": sections}), tmp_path / f"bad{len(sections)}.gguf")
        with pytest.raises(GGUFError, match=needle) as e:
            config_of(path)
        assert "\n" not in str(e.value)

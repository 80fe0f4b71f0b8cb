"""Nothing in a GGUF is silently skipped (issue #29, item 2, the GGUF side): every metadata key is read, known
inert, or the file is refused in one line naming it; every tensor is used or the file is refused; a rotary
scaling kvcli does not compute is refused, linear scaling is read; generation stops on llama.cpp's
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

    from kvcli.model.kquant_encode import add_tensor, copy_fields, finish

    reader = gguf.GGUFReader(str(src), "r")
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


def test_rotary_scalings_linear_is_read_the_others_refused(base, tmp_path):
    import gguf

    V = gguf.GGUFValueType
    linear = variant(base, tmp_path / "linear.gguf", {"llama.rope.scaling.type": ("linear", V.STRING),
                                                      "llama.rope.scaling.factor": (4.0, V.FLOAT32),
                                                      "llama.rope.scaling.original_context_length": (128, V.UINT32)})
    assert config_of(linear).rope_scaling == {"rope_type": "linear", "factor": 4.0}
    none = variant(base, tmp_path / "none.gguf", {"llama.rope.scaling.type": ("none", V.STRING)})
    assert config_of(none).rope_scaling is None
    yarn = variant(base, tmp_path / "yarn.gguf", {"llama.rope.scaling.type": ("yarn", V.STRING),
                                                  "llama.rope.scaling.factor": (4.0, V.FLOAT32)})
    with pytest.raises(GGUFError, match="rope.scaling.type = 'yarn'"):
        config_of(yarn)
    no_factor = variant(base, tmp_path / "nofactor.gguf", {"llama.rope.scaling.type": ("linear", V.STRING)})
    with pytest.raises(GGUFError, match="positive llama.rope.scaling.factor"):
        config_of(no_factor)


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
    freqs = variant(base, tmp_path / "freqs.gguf", tensor=("rope_freqs.weight", np.ones(32, dtype=np.float32)))
    with pytest.raises(GGUFError, match="tensor rope_freqs.weight .* not applied by kvcli"):
        load_gguf(freqs)
    extra = variant(base, tmp_path / "extra.gguf", tensor=("blk.0.attn_q_norm.weight", np.ones(64, dtype=np.float32)))
    with pytest.raises(GGUFError, match="tensor blk.0.attn_q_norm.weight is not part of the llama model"):
        load_gguf(extra)
    config, weights, _ = load_gguf(base)  # the plain file: every tensor used
    assert len(weights) == 2 + 9 * config.num_layers


def test_generation_stops_on_the_end_of_generation_set(base, tmp_path):
    import gguf

    V = gguf.GGUFValueType
    eos = config_of(base).eos_token_ids
    path = variant(base, tmp_path / "eot.gguf", {"tokenizer.ggml.eot_token_id": (7, V.UINT32),
                                                 "tokenizer.ggml.eom_token_id": (9, V.UINT32)})
    assert config_of(path).eos_token_ids == (*eos, 7, 9)


def test_the_cli_refuses_in_one_line(base, tmp_path):
    import gguf

    path = variant(base, tmp_path / "cap.gguf", {"llama.final_logit_softcapping": (30.0, gguf.GGUFValueType.FLOAT32)})
    out = subprocess.run([sys.executable, "-c", "from kvcli.cli import main; main()", "inspect", str(path), "--no-load"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert out.stderr.strip().count("\n") == 0 and "llama.final_logit_softcapping" in out.stderr


HF = dict(model_type="llama", num_attention_heads=4, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
          vocab_size=100)


def test_transformers_5_rope_parameters_are_read():
    """transformers 5 writes rope_theta (and the scaling) inside rope_parameters: read, not defaulted."""
    c = ModelConfig.from_hf_dict({**HF, "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}})
    assert c.rope_theta == 100000.0 and c.rope_scaling is None
    c = ModelConfig.from_hf_dict({**HF, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}})
    assert c.rope_theta == 5e5 and c.rope_scaling["factor"] == 2.0
    assert ModelConfig.from_hf_dict({**HF, "rope_theta": 1e6}).rope_theta == 1e6  # transformers 4's layout
    for bad in ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
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

"""Pre-quantized Hugging Face INT4 checkpoints: AWQ (GEMM), GPTQ (v1 and v2 zero points, sym and asym)
and compressed-tensors pack-quantized W4A16.

Each checkpoint is packed here, by small packers written from each format's published layout (not
from kvcli's loader), out of a matrix known exactly: integer codes, fp16 scales and zero points, whose
dense value (q - z) * s is exact in float32. Loaded through kvcli, it must dequantize to exactly that
matrix, stay packed in memory, and a tiny llama saved in each format must give transformers' logits
on the dense matrices. Unsupported options (act-order, 8 bits, other methods) are one-line errors.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from cli_helpers import one_line_error
from cpu_paths import cpu_mode

from kvcli.cli import app
from kvcli.model.hf_quant import HFQuantError, convert, parse_scheme
from kvcli.model.quant import QuantTensor

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i of a word holds column 8j + ORDER[i]


# --- packers (per the published layouts) ---------------------------------------------------------

def pack_last(vals: torch.Tensor, order: list[int] | None = None) -> torch.Tensor:
    """[R, C] ints 0..15 -> int32 [R, C/8]; nibble i (bits 4i..4i+3) of word j holds column 8j + order[i]."""
    v = vals.numpy().astype(np.uint32)
    order = order or list(range(8))
    out = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.uint32)
    for i, col in enumerate(order):
        out |= (v[:, col::8] & 0xF) << np.uint32(4 * i)
    return torch.from_numpy(out.view(np.int32).copy())


def pack_first(vals: torch.Tensor) -> torch.Tensor:
    """[R, C] ints 0..15 -> int32 [R/8, C]; nibble i of word j holds row 8j + i."""
    return pack_last(vals.t().contiguous()).t().contiguous()


def known_linear(n: int, k: int, g: int, zeros: str, seed: int):
    """codes [N, K], fp16 scales [N, K/G], zeros [N, K/G] ("sym": all 8; "asym": 0..15; "asym1": 1..15)
    and the dense fp32 matrix (q - z) * s (exact: a 5-bit integer times an fp16 scale)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen)
    s = (torch.rand(n, k // g, generator=gen) * 0.02 + 0.002).to(torch.float16)
    lo = {"sym": 8, "asym": 0, "asym1": 1}[zeros]
    z = torch.full((n, k // g), 8) if zeros == "sym" else torch.randint(lo, 16, (n, k // g), generator=gen)
    dense = (q - z.repeat_interleave(g, 1)).float() * s.float().repeat_interleave(g, 1)
    return q, s, z, dense


def pack(fmt: str, prefix: str, q, s, z, g: int) -> dict[str, torch.Tensor]:
    """One linear's tensors in `fmt` ("awq", "gptq", "gptq_v2", "ct")."""
    n, k = q.shape
    if fmt == "awq":
        return {prefix + "qweight": pack_last(q.t(), AWQ_PACK_ORDER),
                prefix + "qzeros": pack_last(z.t(), AWQ_PACK_ORDER), prefix + "scales": s.t().contiguous()}
    if fmt in ("gptq", "gptq_v2"):
        stored = z - 1 if fmt == "gptq" else z  # v1 stores z - 1
        return {prefix + "qweight": pack_first(q.t()), prefix + "qzeros": pack_last(stored.t()),
                prefix + "scales": s.t().contiguous(),
                prefix + "g_idx": (torch.arange(k) // g).to(torch.int32)}
    out = {prefix + "weight_packed": pack_last(q), prefix + "weight_scale": s,
           prefix + "weight_shape": torch.tensor([n, k], dtype=torch.int32)}
    if not bool((z == 8).all()):  # asymmetric: zero points packed along N, stored + 8 like the codes
        out[prefix + "weight_zero_point"] = pack_first(z)
    return out


def quant_config(fmt: str, g: int, sym: bool) -> dict:
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": g, "zero_point": True, "version": "gemm"}
    if fmt in ("gptq", "gptq_v2"):
        return {"quant_method": "gptq", "bits": 4, "group_size": g, "desc_act": False, "sym": sym,
                "checkpoint_format": fmt}
    w = {"num_bits": 4, "type": "int", "symmetric": sym, "strategy": "group", "group_size": g, "actorder": None}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": w, "input_activations": None}},
            "ignore": ["lm_head"]}


# (format, zero points): AWQ is asymmetric only; GPTQ v1 cannot store z = 0 (its z - 1 would be -1).
CASES = [("awq", "asym"), ("gptq", "sym"), ("gptq", "asym1"), ("gptq_v2", "sym"), ("gptq_v2", "asym"),
         ("ct", "sym"), ("ct", "asym")]


@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("fmt,zeros", CASES)
def test_packed_matrix_dequantizes_exactly(fmt, zeros, g):
    n, k = 48, 256
    q, s, z, dense = known_linear(n, k, g, zeros, seed=g)
    raw = pack(fmt, "m.proj.", q, s, z, g)
    file_bytes = sum(t.numel() * t.element_size() for t in raw.values())
    weights, formats = convert(raw, parse_scheme(quant_config(fmt, g, zeros == "sym"), "test"))
    w = weights["m.proj.weight"]
    assert isinstance(w, QuantTensor) and w.kind == "q4" and w.group_size == g and w.shape == (n, k)
    assert torch.equal(w.dequantize(), dense)
    assert sum(formats.values()) == 1 and not raw  # every packed tensor consumed
    # Resident: the packed codes, the file's scales and a uint8 zero (or an fp16 min = -8 s) per group:
    # at most 2 bytes per group over the file, never a dense copy (fp16 would be 2 n k bytes).
    assert w.codes.numel() == n * k // 2 and w.nbytes <= file_bytes + 2 * n * (k // g)
    assert w.nbytes < 2 * n * k / 3
    if zeros == "sym":  # -8 s is exact in fp16: the plain fp16 layout GGUF Q4_0 has
        assert w.min is not None and w.min.dtype == torch.float16


def test_gptq_v1_zero_nibble_is_read_as_autogptq_does():
    """v1 stores z - 1 per nibble and adds 1 back element by element: a stored 15 is z = 16."""
    q, s, _, _ = known_linear(8, 32, 32, "sym", seed=1)
    z = torch.full((8, 1), 16)
    raw = pack("gptq", "p.", q, s, z, 32)  # z - 1 = 15 in every nibble
    w = convert(raw, parse_scheme(quant_config("gptq", 32, False), "t"))[0]["p.weight"]
    assert torch.equal(w.dequantize(), (q - 16).float() * s.float())


@pytest.mark.parametrize("qc,needle", [
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits=8"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "'marlin'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 16}, "group_size 16"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "'gemv'"),
    ({"quant_method": "fp8"}, "'fp8'"),
    ({"quant_method": "compressed-tensors", "format": "naive-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8}}}}, "'naive-quantized'"),
])
def test_unsupported_options_are_named(qc, needle):
    with pytest.raises(HFQuantError, match=needle.replace("[", r"\[")) as e:
        parse_scheme(qc, "ckpt")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("fmt,key", [("gptq_v2", "p.g_idx"), ("ct", "p.weight_g_idx")])
def test_act_order_g_idx_refused(fmt, key):
    q, s, z, _ = known_linear(16, 64, 32, "asym", seed=2)
    raw = pack(fmt, "p.", q, s, z, 32)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    raw[key] = (torch.arange(64) // 32).to(torch.int32)[perm]
    qc = quant_config(fmt, 32, False)
    convert(dict(raw, **{key: raw[key].sort().values}), parse_scheme(qc, "t"))  # k // G: plain groups, read
    with pytest.raises(HFQuantError, match="act-order"):
        convert(raw, parse_scheme(qc, "t"))


# --- a tiny llama in each format against transformers on the dense matrices ----------------------

TINY = dict(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
            tie_word_embeddings=False)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory, gguf_path):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tok")
    AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(str(d))
    return d


def tiny_pair(root, tokenizer_files, fmt: str, zeros: str, g: int):
    """(quantized folder, dense reference model): the same random llama, its linears (q - z) * s."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    ref = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    state = {name: t.detach().clone() for name, t in ref.state_dict().items()}
    packed: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for n_, p in ref.named_parameters():
            if "norm" in n_:
                p.add_(torch.randn_like(p) * 0.1)
                state[n_] = p.detach().clone()
        for i in range(TINY["num_hidden_layers"]):
            for j, lin in enumerate(LINEARS):
                name = f"model.layers.{i}.{lin}"
                w = ref.get_submodule(name).weight
                q, s, z, dense = known_linear(*w.shape, g, zeros, seed=100 * i + j)
                w.copy_(dense)
                del state[name + ".weight"]
                packed.update(pack(fmt, name + ".", q, s, z, g))
    out = root / f"{fmt}-{zeros}-g{g}"
    out.mkdir()
    cfg = ref.config.to_dict()
    cfg["quantization_config"] = quant_config(fmt, g, zeros == "sym")
    (out / "config.json").write_text(json.dumps(cfg))
    save_file({**{k: v.to(torch.float16) for k, v in state.items()}, **packed}, str(out / "model.safetensors"))
    for f in tokenizer_files.iterdir():
        shutil.copy(f, out / f.name)
    # The reference holds exactly what the folder holds: fp16 embeddings / norms / lm_head, as fp32.
    with torch.no_grad():
        for n_, p in ref.named_parameters():
            if n_ in state:
                p.copy_(state[n_].to(torch.float16).float())
    return out, ref


@pytest.mark.slow
@pytest.mark.parametrize("fmt,zeros,g", [("awq", "asym", 128), ("gptq", "sym", 128), ("gptq", "asym1", 64),
                                         ("gptq_v2", "asym", 32), ("ct", "sym", 64), ("ct", "asym", 128)])
def test_tiny_model_matches_transformers_on_the_dense_matrices(tmp_path, tokenizer_files, fmt, zeros, g):
    from test_loading import logits_through_engine

    from kvcli.llm import LLM

    path, ref = tiny_pair(tmp_path, tokenizer_files, fmt, zeros, g)
    ids = list(range(200, 264))
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    exact = LLM(str(path), dequantize=True, kv_budget="16MiB")
    got = logits_through_engine(exact.engine, ids, chunk=32)
    assert (got - want).abs().max().item() < 1e-4
    # The default CPU path: the same codes through kvcli's int8dot kernel (two int8 levels per activation)
    # or, without it, torch's int4 kernel (bf16 activations and scales).
    llm = LLM(str(path), kv_budget="16MiB")
    mode = cpu_mode("int4-cpu")
    assert llm.engine.linear_mode == mode
    dense_bytes = sum(ref.get_submodule(f"model.layers.{i}.{lin}").weight.numel() * 2
                      for i in range(TINY["num_hidden_layers"]) for lin in LINEARS)
    assert llm.engine.weight_bytes()["layers"] < dense_bytes / 3  # packed, not an fp16 copy
    got4 = logits_through_engine(llm.engine, ids, chunk=32)
    # Not bit-exact (int8dot: quantized activations; int4-cpu: bf16 activations, scales and zeros and a
    # bf16 vocabulary projection), but close: a wrong nibble order or zero point would leave the logits
    # nearly uncorrelated.
    rel = ((got4 - want).abs().max() / want.abs().max()).item()
    corr = torch.corrcoef(torch.stack([got4.flatten(), want.flatten()]))[0, 1].item()
    print(f"{fmt} {zeros} g{g}: {mode} max error {rel:.4f} of the largest logit, correlation {corr:.5f}")
    bound = 1e-2 if mode == "int8dot-cpu" else 0.05  # int8dot: mostly the bf16 vocabulary projection
    assert rel < bound and corr > 0.999, f"{mode}: max error {rel:.4f} of the largest logit, correlation {corr:.5f}"
    if fmt == "awq":  # inspect loads the folder as `continue` would and reports what stays resident
        r = runner.invoke(app, ["inspect", str(path), "--json"])
        assert r.exit_code == 0, r.output
        rep = json.loads(r.stdout)
        assert {"awq:I32", "awq:F16", "F16"} == {g["type"] for g in rep["tensors"]}
        assert rep["linear_paths"] == mode and rep["resident"]["layers"] < dense_bytes / 3


# --- refused through the CLI, one line -----------------------------------------------------------

runner = CliRunner()


def small_folder(root, qc: dict, tensors: dict[str, torch.Tensor]):
    from safetensors.torch import save_file

    root.mkdir()
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
           "max_position_embeddings": 256, "quantization_config": qc}
    (root / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(root / "model.safetensors"))
    return root


def test_act_order_and_8_bit_refused_by_the_cli(tmp_path):
    q, s, z, _ = known_linear(64, 64, 32, "asym", seed=3)
    t = pack("gptq_v2", "model.layers.0.self_attn.q_proj.", q, s, z, 32)
    t["model.layers.0.self_attn.q_proj.g_idx"] = t["model.layers.0.self_attn.q_proj.g_idx"].flip(0)
    act = small_folder(tmp_path / "act", dict(quant_config("gptq_v2", 32, False), desc_act=True), t)
    eight = small_folder(tmp_path / "eight", {"quant_method": "gptq", "bits": 8, "group_size": 128},
                         {"x": torch.zeros(2)})
    text = tmp_path / "in.txt"
    text.write_text("Once upon a time")
    for folder, needle in [(act, "act-order"), (eight, "bits=8")]:
        one_line_error(runner.invoke(app, ["inspect", str(folder)]), needle)
        one_line_error(runner.invoke(app, ["continue", str(text), "--model", str(folder), "-n", "2"]), needle)


def test_inspect_groups_the_packed_tensors_apart(tmp_path):
    q, s, z, _ = known_linear(64, 64, 32, "asym", seed=4)
    t = pack("awq", "model.layers.0.self_attn.q_proj.", q, s, z, 32)
    folder = small_folder(tmp_path / "awq", quant_config("awq", 32, False), {**t, "model.norm.weight": torch.ones(64)})
    r = runner.invoke(app, ["inspect", str(folder), "--no-load", "--json"])
    assert r.exit_code == 0, r.output
    groups = {g["type"]: (g["count"], g["bytes"]) for g in json.loads(r.stdout)["tensors"]}
    assert groups == {"awq:I32": (2, (64 * 8 + 2 * 8) * 4), "awq:F16": (1, 2 * 64 * 2), "F32": (1, 64 * 4)}


# --- bitsandbytes 4-bit folders, as transformers saves them ----------------------------------------

def bnb_dequantized_model(path, config):
    """The dense model bitsandbytes' own dequantize_4bit makes of a saved 4-bit folder (float32)."""
    import bitsandbytes.functional as bnbf
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    raw = load_file(str(path / "model.safetensors"))
    state = {}
    for name in [n for n in raw if ".quant_state." in n]:
        w = name[: name.index(".weight.") + len(".weight")]
        parts = {k[len(w) + 1:]: raw[k] for k in raw if k.startswith(w + ".")}
        state[w] = bnbf.dequantize_4bit(raw[w], bnbf.QuantState.from_dict(parts, torch.device("cpu"))).float()
    # The rest (embeddings, norms, lm_head) as saved; ".weight." names are quant-state parts.
    state.update({k: v.float() for k, v in raw.items() if k not in state and ".weight." not in k})
    model = LlamaForCausalLM(config).eval()
    model.load_state_dict(state, strict=True)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("quant_type,double", [("nf4", False), ("fp4", True)])
def test_bitsandbytes_4bit_folder_matches_transformers(tmp_path, tokenizer_files, quant_type, double):
    """A folder transformers saved with load_in_4bit: kvcli runs its saved bytes through bitsandbytes'
    matmul_4bit; the logits equal the dense model bitsandbytes dequantizes from the same file, and are
    close to transformers' own 4-bit model (which runs the CPU 4-bit matmul in bf16)."""
    pytest.importorskip("bitsandbytes")
    from test_loading import logits_through_engine
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    from kvcli.llm import LLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(str(tmp_path / "dense"))
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=double,
                             bnb_4bit_compute_dtype=torch.float32)
    hf4 = AutoModelForCausalLM.from_pretrained(str(tmp_path / "dense"), quantization_config=bnb,
                                               dtype=torch.float32, device_map="cpu").eval()
    path = tmp_path / "bnb"
    hf4.save_pretrained(str(path))
    for f in tokenizer_files.iterdir():
        shutil.copy(f, path / f.name)
    ids = list(range(200, 264))
    with torch.no_grad():
        want = bnb_dequantized_model(path, LlamaConfig(**TINY))(torch.tensor([ids])).logits[0]
        hf_logits = hf4(torch.tensor([ids])).logits[0]
    llm = LLM(str(path), kv_budget="16MiB")
    assert llm.engine.linear_mode == "nf4"
    fmts = [k for k in llm.engine.formats if k.startswith("bnb-")]
    assert fmts == [f"bnb-{quant_type} blocksize 64" + (" double-quant" if double else "")]
    n_weights = sum(p.numel() for n, p in LlamaForCausalLM(LlamaConfig(**TINY)).named_parameters() if "proj" in n)
    assert llm.engine.weight_bytes()["layers"] < n_weights * 2 / 3  # the saved 4-bit bytes, not fp16
    got = logits_through_engine(llm.engine, ids, chunk=32)
    assert (got - want).abs().max().item() < 1e-4
    rel = ((got - hf_logits).abs().max() / hf_logits.abs().max()).item()
    corr = torch.corrcoef(torch.stack([got.flatten(), hf_logits.flatten()]))[0, 1].item()
    assert rel < 0.05 and corr > 0.999, f"vs transformers' 4-bit model: {rel:.4f} of the largest logit, corr {corr:.5f}"
    # --dequantize: bitsandbytes' own dequantization once, one dense matmul per linear.
    dense = logits_through_engine(LLM(str(path), dequantize=True, kv_budget="16MiB").engine, ids, chunk=32)
    assert (dense - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("fmt,sym", [("awq", False), ("gptq", True), ("gptq", False), ("gptq_v2", False),
                                     ("compressed-tensors", True), ("compressed-tensors", False)])
def test_benchmark_encoder_round_trips(fmt, sym):
    """hf_quant_encode (used by kvcli/bench/hf_quant.py) writes what the loader reads back exactly."""
    from kvcli.model.hf_quant_encode import encode, quantization_config, rtn_quantize

    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(5)) * 0.05
    q, s, z = rtn_quantize(w, 64, sym)
    if fmt == "gptq":
        z = z.clamp(min=1)  # v1 cannot store z = 0
    raw = encode(fmt, "p.", q, s, z)
    got = convert(raw, parse_scheme(quantization_config(fmt, 64, sym), "t"))[0]["p.weight"]
    want = (q - z.repeat_interleave(64, 1)).float() * s.float().repeat_interleave(64, 1)
    assert torch.equal(got.dequantize(), want)
    assert (want - w).abs().max() <= s.float().max()  # round to nearest: within a step of the dense weight


@pytest.mark.parametrize("qc,needle", [({"quant_method": "bitsandbytes", "load_in_8bit": True}, "8-bit"),
                                       ({"quant_method": "bitsandbytes", "load_in_4bit": True,
                                         "bnb_4bit_quant_storage": "bfloat16"}, "'bfloat16'")])
def test_bitsandbytes_options_refused(tmp_path, qc, needle):
    from kvcli.model.loader import ModelLoadError, load_weights

    folder = small_folder(tmp_path / "bnb", qc, {"x": torch.zeros(2)})
    with pytest.raises(ModelLoadError, match=needle):
        load_weights(str(folder))

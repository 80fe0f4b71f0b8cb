"""GGUF Q4_0..Q8_0 and K-quant tensors: kvcli's resident forms against independent references.

References: gguf-py's `dequantize` for single blocks (bit for bit), and transformers' own GGUF loader
for a whole model written with gguf's GGUFWriter (tests/kquant_model.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvcli.model.gguf_loader import _DECODERS
from kvcli.model.kquant_encode import quantize_q4_k, quantize_q6_k, random_blocks
from kvcli.model.layers import planned_linear as Linear
from kvcli.model.quant import QuantTensor

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


def _decode(type_name: str, raw: np.ndarray, n: int, k: int) -> QuantTensor:
    return _DECODERS[type_name](torch.from_numpy(raw.copy()), n, k)


@pytest.mark.parametrize("type_name", TYPES)
def test_random_blocks_dequantize_like_gguf_bit_for_bit(type_name):
    import gguf

    rng = np.random.default_rng(TYPES.index(type_name))
    n, k = 24, 512
    raw = random_blocks(type_name, n, k, rng, scale=0.1)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    q = _decode(type_name, raw, n, k)
    ours = q.dequantize().numpy()
    assert ours.shape == ref.shape == (n, k)
    assert np.isfinite(ref).all()
    if type_name == "Q4_0":  # kvcli's d * q + (-8 d) gives +0 where gguf-py's d * (q - 8) gives -0
        assert np.array_equal(ours, ref)
    else:
        assert np.array_equal(ours.view(np.int32), ref.view(np.int32))
    # Resident as in the file: the K-quants' per-group 6-bit scales/mins take a byte each (+2.8 %);
    # Q4_0 keeps its existing form with an explicit fp16 min (-8 d) that the Triton GEMM reads (+11 %).
    assert raw.nbytes <= q.nbytes <= (1.12 if type_name == "Q4_0" else 1.03) * raw.nbytes


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K", "Q5_0"])
def test_row_subsets_and_fusion_stay_exact(type_name):
    """Un-permuting q/k rows and fusing q/k/v or gate/up happen on the packed form."""
    rng = np.random.default_rng(7)
    a = _decode(type_name, random_blocks(type_name, 16, 256, rng), 16, 256)
    b = _decode(type_name, random_blocks(type_name, 32, 256, rng), 32, 256)
    idx = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    fused = QuantTensor.cat([a.rows(idx), b])
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize()[idx], b.dequantize()]))


@pytest.mark.parametrize("encode,type_name,tol", [(quantize_q4_k, "Q4_K", 0.1), (quantize_q6_k, "Q6_K", 0.03)])
def test_encoders_round_trip_through_gguf_py(encode, type_name, tol):
    """kvcli's encoders (used for test files and the benchmark) write what gguf-py reads back."""
    import gguf

    x = np.random.default_rng(1).standard_normal((32, 512)).astype(np.float32) * 0.05
    y = gguf.quants.dequantize(encode(x), gguf.GGMLQuantizationType[type_name])
    rel = np.sqrt(((y - x) ** 2).mean()) / x.std()
    assert rel < tol, rel
    assert rel > 1e-4  # really quantized


@pytest.mark.parametrize("type_name,mode", [("Q4_K", "int4-cpu"), ("Q4_1", "int4-cpu"), ("Q5_K", "int4x2-cpu"),
                                            ("Q6_K", "int4x2-cpu"), ("Q5_0", "int4x2-cpu"), ("Q5_1", "int4x2-cpu"),
                                            ("Q8_0", "int4x2-cpu")])
@pytest.mark.parametrize("rows", [32, 24])
def test_linear_picks_a_packed_path_per_kind(type_name, mode, rows):
    from kquant_model import kernel_bytes

    rng = np.random.default_rng(3)
    q = _decode(type_name, random_blocks(type_name, rows, 512, rng, scale=0.02), rows, 512)
    lin = Linear(q, None, "int4-cpu", torch.float32)
    if rows % 16:  # torch's int4 kernel wants rows in multiples of 16: the exact per-call paths instead
        mode = "dequant-torch"
    assert lin.mode == mode
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    ref = x @ q.dequantize().T
    y = lin(x)
    if mode == "dequant-torch":  # dequantized per call in fp32: the dense result exactly
        assert torch.equal(y, ref)
        assert lin.nbytes == q.nbytes
    else:  # bf16 activations and scales: close, not exact (tests/test_int4x2.py measures how close)
        assert (y - ref).abs().max() < 0.02 * ref.abs().max()
        assert lin.nbytes == kernel_bytes(type_name, rows, 512, mode)
    assert Linear(q, None, "dense", torch.float32).mode == "dense"


def test_unsupported_type_fails_at_load_naming_tensor_and_type(tmp_path):
    import gguf

    from kvcli.model.loader import ModelLoadError, load_weights

    path = tmp_path / "q2k.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for key, v in [("vocab_size", 8), ("block_count", 1), ("embedding_length", 256), ("feed_forward_length", 256),
                   ("attention.head_count", 4), ("context_length", 64)]:
        w.add_uint32(f"llama.{key}", v)
    w.add_tensor("token_embd.weight", np.zeros((8, 256), dtype=np.float16))
    rng = np.random.default_rng(0)
    w.add_tensor("blk.0.attn_q.weight", random_blocks("Q2_K", 256, 256, rng),
                 raw_dtype=gguf.GGMLQuantizationType.Q2_K)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ModelLoadError) as e:
        load_weights(str(path))
    msg = str(e.value)
    assert "blk.0.attn_q.weight" in msg and "Q2_K" in msg and "\n" not in msg


def test_gguf_without_required_metadata_is_a_one_line_error(tmp_path):
    import gguf

    from kvcli.model.loader import ModelLoadError, load_weights

    path = tmp_path / "bare.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.attention.head_count", 4)
    w.add_tensor("token_embd.weight", np.zeros((8, 256), dtype=np.float16))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ModelLoadError, match="llama.embedding_length"):
        load_weights(str(path))


# --- A whole K-quant model against transformers --------------------------------------------------

@pytest.fixture(scope="module")
def tiny_runs(tiny_kquant):
    """Teacher-forced logits of kvcli's exact and packed paths and transformers' on the same ids."""
    from test_vs_transformers import teacher_forced_logits
    from transformers import AutoModelForCausalLM

    from dataclasses import replace

    from kvcli.engine.llm_engine import EngineOptions, LLMEngine
    from kvcli.llm import LLM
    from kvcli.model.loader import load_weights

    loaded = load_weights(str(tiny_kquant))  # read once; each engine takes its own dict of the tensors
    exact = LLM.from_engine(LLMEngine(replace(loaded, weights=dict(loaded.weights)),
                                      EngineOptions(dequantize=True, kv_budget="32MiB")))
    packed = LLM.from_engine(LLMEngine(loaded, EngineOptions(kv_budget="32MiB")))
    sample = Path(__file__).resolve().parents[1] / "samples" / "keepers-log.txt"
    # 256 positions: top-1 agreement counts near-ties of this random model's flat logits (a 96-position
    # sample moved by one flip per 1 %: 0.948 with both layers' linears in bf16 kernels, 0.958 needed).
    ids = exact.tokenizer.encode(sample.read_text(encoding="utf-8"))[:256]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_kquant.parent), gguf_file=tiny_kquant.name,
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    return {
        "exact": teacher_forced_logits(exact.engine, ids, prefill=232, chunk=40),
        "packed": teacher_forced_logits(packed.engine, ids, prefill=232, chunk=40),
        "ref": ref, "packed_engine": packed.engine, "exact_engine": exact.engine,
    }


def test_kquant_model_exact_path_matches_transformers(tiny_runs):
    assert tiny_runs["exact_engine"].linear_mode == "dense"
    err = (tiny_runs["exact"] - tiny_runs["ref"]).abs().max().item()
    assert err < 1e-3, err
    assert tiny_runs["ref"].std() > 1.0  # logits that discriminate, not a near-constant output


def test_kquant_model_packed_path_agrees_with_transformers(tiny_runs):
    """Top-1 kept wherever the reference is decisive, and always within its top 2.

    Not the bundled model's overall 0.95 top-1 threshold (test_vs_transformers.py, kept there): this
    random model's logits are flat (std ~8, and ~20 % of positions have their top two within 0.5),
    while the packed paths' bf16 activations move a logit by ~0.5 (median abs error). So overall top-1
    agreement measures near-ties and the ISA's rounding (0.957 with torch's AVX-512 kernels, 0.949 with
    its AVX2 ones, every miss a gap < 0.28). A wrong decode would flip decisive positions too."""
    from kquant_model import LAYER_TYPES, cpu_path

    engine = tiny_runs["packed_engine"]
    # int8dot-cpu where kvcli's kernel builds (torch's otherwise: Q4_K packed int4, Q5/Q6/Q8 as two nibbles)
    assert engine.linear_mode == "+".join(dict.fromkeys(cpu_path(t) for types in LAYER_TYPES for t in types.values()))
    ours, ref = tiny_runs["packed"], tiny_runs["ref"]
    top1 = ours.argmax(-1)
    best2 = ref.topk(2, dim=-1)
    decisive = (best2.values[:, 0] - best2.values[:, 1]) > 0.5
    assert decisive.float().mean() >= 0.6  # most positions count
    agree_decisive = (top1 == best2.indices[:, 0])[decisive].float().mean().item()
    in_top2 = (best2.indices == top1[:, None]).any(-1).float().mean().item()
    assert agree_decisive >= 0.99, agree_decisive
    assert in_top2 >= 0.99, in_top2


def test_kquant_model_stays_packed_in_memory(tiny_runs):
    """Resident = the CPU kernels' forms, nothing dense. int8dot-cpu: Q4_K 1.03x its file bytes (the file's
    8-bit sub-scales), Q8_0 1.0x, Q6_K 1.0x, Q5_0 1.0x, Q5_1 1.0x, Q5_K 1.02x (the file's 5/6 bits).
    Torch's forms alone (KVCLI_NATIVE=0): Q4_K 1.11x, Q8_0 1.06x, Q5_* 1.5-1.64x, Q6_K 1.52x."""
    import gguf
    from kquant_model import LAYER_TYPES, cpu_path, kernel_bytes, tensor_shapes

    model = tiny_runs["packed_engine"].model
    file_linear = 0  # the file's bytes for the layer linears, from the GGML block sizes
    expected = 0
    for types in LAYER_TYPES:
        for name, (n, k) in tensor_shapes().items():
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[types[name]]]
            file_linear += n * k // block * size
            expected += kernel_bytes(types[name], n, k)
    resident = sum(lin.nbytes for l in model.layers for lin in (l.qkv, l.o, l.gate_up, l.down))
    assert resident == expected, (resident, expected)
    print(f"resident {resident} vs file {file_linear}: {resident / file_linear:.2f}x")
    bound = 1.05 if cpu_path("Q6_K") == "int8dot-cpu" else 1.65
    assert file_linear <= resident <= bound * file_linear, (resident, file_linear)
    assert model.embed.nbytes == 49152 * 256 * 2  # the F16 embedding stays half precision

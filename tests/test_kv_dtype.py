"""KV cache formats: int8 / fp8 quantization error, the torch backend over int8 and fp8 caches on
ragged, poisoned batches, byte counts, and option errors. (Model-level agreement: test_kv_dtype_engine.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from kvcli.attention.invariant_backend import InvariantAttentionBackend
from kvcli.attention.torch_backend import TorchAttentionBackend
from kvcli.config import preset_config
from kvcli.kvcache.kv_cache import LayerKV
from kvcli.kvcache.kv_dtype import FP8_QMAX, dequantize, kv_dtype_of, quantize, quantize_int8
from kvcli.options import ConfigError, EngineOptions

from test_torch_backend import make_batch, reference


def test_int8_round_trip_error_is_at_most_half_a_step():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200, 3, 64, generator=gen) * torch.logspace(-3, 3, 200)[:, None, None]
    x[5, 1] = 0  # an all-zero vector: scale 0, back to exact zeros
    codes, scale = quantize_int8(x)
    assert codes.dtype == torch.int8 and scale.shape == x.shape[:-1]
    back = dequantize(codes, scale, torch.float32)
    err = (back - x).abs()
    bound = scale.unsqueeze(-1) / 2 * (1 + 1e-5) + 1e-30
    assert bool((err <= bound).all()), float((err / bound).max())
    assert bool((back[5, 1] == 0).all())
    # Each vector uses the full code range: its absmax maps to +-127.
    assert int(codes.abs().amax(-1).min()) == 127 or bool((x.abs().amax(-1) == 0).any())


def test_fp8_round_trip_error_is_within_e4m3_rounding():
    """e4m3 keeps 3 mantissa bits: a value in the normal range (|x / scale| >= 2^-6) comes back within
    2^-4 of itself relative, a smaller one within half a subnormal step (2^-10 scale)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200, 3, 64, generator=gen) * torch.logspace(-3, 3, 200)[:, None, None]
    x[7, 2] = 0
    codes, scale = quantize(x, torch.float8_e4m3fn)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == x.shape[:-1]
    assert torch.equal(scale, x.abs().amax(-1) / FP8_QMAX)
    back = dequantize(codes, scale, torch.float32)
    assert torch.isfinite(back).all() and bool((back[7, 2] == 0).all())
    s = scale.unsqueeze(-1)
    bound = torch.maximum(x.abs() * 2**-4, s * 2**-10) * (1 + 1e-5) + 1e-30
    err = (back - x).abs()
    assert bool((err <= bound).all()), float((err / bound).max())
    # The absmax of each vector maps to +-448 exactly.
    assert bool((codes.float().abs().amax(-1)[scale > 0] == FP8_QMAX).all())
    # e4m3 is coarser than int8 for the large entries of a vector (steps of 32 at the top of +-448 vs 1
    # of +-127) and finer for the small ones: the mean error here is 3.4x int8's (4.2x in RMS on
    # Gaussian vectors), which is what fp8 KV costs over int8 at equal bytes.
    int8_err = (dequantize(*quantize_int8(x), torch.float32) - x).abs().mean()
    assert err.mean() < 5 * int8_err


def test_bytes_per_token_include_scales():
    c = preset_config("smollm2-135m")  # 30 layers, 3 KV heads, head_dim 64
    fp16 = c.kv_bytes_per_token("fp16")
    assert c.kv_bytes_per_token("fp32") == 2 * fp16 == 2 * 30 * 3 * 64 * 4
    assert c.kv_bytes_per_token("int8") == 2 * 30 * 3 * (64 + 4)
    assert c.kv_bytes_per_token("int8") / fp16 <= 0.55
    assert c.kv_bytes_per_token(torch.bfloat16) == fp16
    assert c.kv_bytes_per_token("fp8") == c.kv_bytes_per_token("int8")


@pytest.mark.parametrize("backend", [TorchAttentionBackend, InvariantAttentionBackend])
@pytest.mark.parametrize("storage", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("g", [1, 3])
@pytest.mark.parametrize("permute", [False, True])
def test_quantized_cache_through_torch_backend_matches_reference(storage, g, permute, backend):
    """Ragged mixed batch (decodes batched and per request, prefill chunks over a prefix): written
    through write_kv into an int8 / fp8 cache whose unowned blocks have NaN scales, read back.
    Equals the dense reference on the quantized-then-dequantized K/V, and is close to full precision."""
    q_lens, kv_lens = [1, 1, 1, 1, 7, 20, 1], [5, 40, 33, 17, 7, 53, 70]
    kvh, d, bs = 2, 32, 16
    q, new_k, new_v, k_f, v_f, meta, dense_k, dense_v = make_batch(q_lens, kv_lens, kvh, g, d, bs, 40, permute)
    (kc, ks), (vc, vs) = quantize(k_f, storage), quantize(v_f, storage)  # NaN blocks -> NaN scales (poison)
    cache = LayerKV(kc, vc, ks, vs)
    backend = backend()
    backend.write_kv(new_k, new_v, cache, meta)
    scale = 1 / math.sqrt(d)
    out = backend.forward(q, cache, meta, scale)
    assert torch.isfinite(out).all()
    qd = [dequantize(*quantize(k, storage), torch.float32) for k in dense_k]
    vd = [dequantize(*quantize(v, storage), torch.float32) for v in dense_v]
    torch.testing.assert_close(out, reference(q, qd, vd, q_lens, kv_lens, g, scale), atol=2e-5, rtol=1e-4)
    full = reference(q, dense_k, dense_v, q_lens, kv_lens, g, scale)
    assert (out - full).abs().max() < (0.03 if storage == torch.int8 else 0.1)


def _cpu_kv_dtype(opts: EngineOptions, quantized_weights: bool = False):
    """What an engine with `opts` on the CPU stores (its torch backend unless asked otherwise)."""
    from kvcli.engine.llm_engine import native_attention_available, pick_backend

    cpu = torch.device("cpu")
    return opts.resolve_kv_dtype(cpu, backend=pick_backend(opts.attention_backend, cpu).name,
                                 quantized_weights=quantized_weights, native_attention=native_attention_available)


def test_kv_dtype_options():
    assert _cpu_kv_dtype(EngineOptions(kv_dtype="int8")) == kv_dtype_of("int8")
    assert _cpu_kv_dtype(EngineOptions()).name == "fp32"
    # INT4-resident weights on CPU: fp16 where kvcli's C decode-attention kernel runs; the exact path and
    # the batch-invariant backend keep the compute dtype
    from kvcli.attention.torch_backend import native_attention

    quantized = _cpu_kv_dtype(EngineOptions(), quantized_weights=True).name
    assert quantized == ("fp16" if native_attention() is not None else "fp32")
    for opts in (EngineOptions(dequantize=True), EngineOptions(attention_backend="invariant")):
        assert _cpu_kv_dtype(opts, quantized_weights=True).name == "fp32"
    assert _cpu_kv_dtype(EngineOptions(kv_dtype="bfloat16")).name == "bf16"
    with pytest.raises(ConfigError, match="--kv-dtype must be one of auto, fp32, fp16, bf16, int8, fp8"):
        EngineOptions(kv_dtype="int3")
    assert _cpu_kv_dtype(EngineOptions(kv_dtype="fp8")) == kv_dtype_of("fp8")
    assert kv_dtype_of("fp8").storage == torch.float8_e4m3fn


def test_resolve_kv_dtype_is_a_function_of_plain_facts():
    """auto, decided in one place from facts alone: no backend import, no kernel build."""
    from kvcli.kvcache.kv_dtype import resolve_kv_dtype

    cpu = dict(device_type="cpu", compute_dtype=torch.float32, dequantize=False, backend="torch",
               quantized_weights=True, native_attention=True)
    assert resolve_kv_dtype(None, **cpu).name == "fp16"
    assert resolve_kv_dtype("auto", **cpu).name == "fp16"
    assert resolve_kv_dtype("int8", **cpu).name == "int8"  # an explicit format always wins
    for change in (dict(native_attention=False), dict(quantized_weights=False), dict(dequantize=True),
                   dict(backend="invariant"), dict(backend="triton")):
        assert resolve_kv_dtype(None, **{**cpu, **change}).name == "fp32", change
    gpu = {**cpu, "device_type": "cuda", "backend": "triton"}
    assert resolve_kv_dtype(None, **{**gpu, "compute_dtype": torch.bfloat16}).name == "bf16"
    assert resolve_kv_dtype(None, **{**gpu, "compute_dtype": torch.float16}).name == "fp16"
    assert resolve_kv_dtype(None, **{**cpu, "backend": None}).name == "fp16"  # a simulation
    # The kernel is asked about only when the answer depends on it (the first ask may compile it).
    asked = []
    probe = lambda: asked.append(1) or True  # noqa: E731
    assert resolve_kv_dtype(None, **{**cpu, "dequantize": True, "native_attention": probe}).name == "fp32"
    assert resolve_kv_dtype("int8", **{**cpu, "native_attention": probe}).name == "int8"
    assert not asked
    assert resolve_kv_dtype(None, **{**cpu, "native_attention": probe}).name == "fp16" and asked == [1]


def test_kv_dtype_carries_its_range_and_kernel_codes():
    """qmax and the kernels' codes live in one table (KV_DTYPES) that the kernel launchers read (through
    kvcli_kernels/kv_formats.py); the numbers themselves are what the C and Triton kernels were written for."""
    from kvcli.kvcache.kv_dtype import KV_DTYPES
    from kvcli_kernels import cpu_attention, cpu_rope_kv

    assert {n: d.qmax for n, d in KV_DTYPES.items()} == {"fp32": 0, "fp16": 0, "bf16": 0, "int8": 127, "fp8": 448}
    assert {n: d.kernel_code for n, d in KV_DTYPES.items()} == {"fp32": 0, "fp16": 1, "bf16": 2, "int8": 3, "fp8": 4}
    assert {n: d.quant_code for n, d in KV_DTYPES.items()} == {"fp32": 0, "fp16": 0, "bf16": 0, "int8": 1, "fp8": 2}
    assert cpu_attention.DTYPE_CODES == {d.storage: d.kernel_code for d in KV_DTYPES.values()}
    assert cpu_rope_kv.DTYPE_CODES == cpu_attention.DTYPE_CODES  # the rotary + KV store writes every format
    cache_write = pytest.importorskip("kvcli_kernels.cache_write")
    assert cache_write.QUANT_FORMATS == {d.storage: (d.quant_code, d.qmax) for d in KV_DTYPES.values() if d.quantized}


def test_int8_cache_blocks_carry_scales_through_zero_copy_and_swap():
    from kvcli.kvcache.kv_cache import KVCache

    c = preset_config("smollm2-135m")
    cache = KVCache(c, num_blocks=6, block_size=16, kv_dtype="int8", device=torch.device("cpu"))
    layer = cache.layers[0]
    assert layer.quantized and len(layer.tensors()) == 4
    assert cache.nbytes == 7 * 16 * c.kv_bytes_per_token("int8")  # 6 usable blocks + the null block
    gen = torch.Generator().manual_seed(1)
    for t in layer.tensors():
        t[1] = (torch.rand(t[1].shape, generator=gen) * 100).to(t.dtype)
    want = [t[1].clone() for t in layer.tensors()]
    cache.copy_blocks([(1, 2)])
    assert all(torch.equal(t[2], w) for t, w in zip(layer.tensors(), want))
    host = cache.swap_out([1])
    cache.zero_blocks([1])
    assert all(not t[1].any() for t in layer.tensors())
    cache.swap_in([3], host)
    assert all(torch.equal(t[3], w) for t, w in zip(layer.tensors(), want))


def test_fp8_bit_conversion_is_exact_for_every_code():
    """The torch decode path reads fp8 codes as fp16 bits (code / 256), not through torch's slow fp8 ->
    fp32 copy: every finite e4m3fn code, subnormals and -0 included, must come back exactly."""
    from kvcli.attention.torch_backend import FP8_UNIT
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    codes = codes[~codes.float().isnan()].reshape(1, -1, 2)  # [kvh=1, L, D=2], head-major
    got = TorchAttentionBackend()._heads_f32(codes, "k") * FP8_UNIT
    want = codes.float()
    assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())


@pytest.mark.parametrize("storage", [torch.int8, torch.float8_e4m3fn, torch.float16, torch.bfloat16],
                         ids=["int8", "fp8", "fp16", "bf16"])
def test_prefill_read_through_scratch_equals_dequantize(storage):
    """Prefill chunks read a converted cache into reused head-major buffers (dequantized in place): the
    values must be dequantize()'s bit for bit, for consecutive (view) and scattered (gathered) blocks."""
    x = torch.randn(20, 16, 3, 64, generator=torch.Generator().manual_seed(3)) * 5
    c, s = quantize(x, storage) if storage in (torch.int8, torch.float8_e4m3fn) else (x.to(storage), None)
    be = TorchAttentionBackend()
    for blocks in (slice(2, 9), torch.tensor([5, 1, 7, 3, 11, 0, 19])):
        got = be._read_f32(c, s, blocks, 100, "k")
        assert got.is_contiguous() and got.shape == (3, 100, 64)
        assert torch.equal(got, be._read(c, s, blocks, 100, torch.float32))

"""KV cache formats: int8 quantization error, the torch backend over an int8 cache on ragged,
poisoned batches, byte counts, and option errors. (Model-level agreement: test_kv_dtype_engine.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from kvcli.attention.torch_backend import TorchAttentionBackend
from kvcli.config import preset_config
from kvcli.kvcache.kv_cache import LayerKV
from kvcli.kvcache.kv_dtype import dequantize, kv_dtype_of, quantize_int8
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


def test_bytes_per_token_include_scales():
    c = preset_config("smollm2-135m")  # 30 layers, 3 KV heads, head_dim 64
    fp16 = c.kv_bytes_per_token("fp16")
    assert c.kv_bytes_per_token("fp32") == 2 * fp16 == 2 * 30 * 3 * 64 * 4
    assert c.kv_bytes_per_token("int8") == 2 * 30 * 3 * (64 + 4)
    assert c.kv_bytes_per_token("int8") / fp16 <= 0.55
    assert c.kv_bytes_per_token(torch.bfloat16) == fp16


@pytest.mark.parametrize("g", [1, 3])
@pytest.mark.parametrize("permute", [False, True])
def test_int8_cache_through_torch_backend_matches_reference(g, permute):
    """Ragged mixed batch (decodes batched and per request, prefill chunks over a prefix): written
    through write_kv into an int8 cache whose unowned blocks have NaN scales, read back dequantized.
    Equals the dense reference on the quantized-then-dequantized K/V, and is close to full precision."""
    q_lens, kv_lens = [1, 1, 1, 1, 7, 20, 1], [5, 40, 33, 17, 7, 53, 70]
    kvh, d, bs = 2, 32, 16
    q, new_k, new_v, k_f, v_f, meta, dense_k, dense_v = make_batch(q_lens, kv_lens, kvh, g, d, bs, 40, permute)
    (kc, ks), (vc, vs) = quantize_int8(k_f), quantize_int8(v_f)  # NaN blocks -> NaN scales (poison)
    cache = LayerKV(kc, vc, ks, vs)
    backend = TorchAttentionBackend()
    backend.write_kv(new_k, new_v, cache, meta)
    scale = 1 / math.sqrt(d)
    out = backend.forward(q, cache, meta, scale)
    assert torch.isfinite(out).all()
    qd = [dequantize(*quantize_int8(k), torch.float32) for k in dense_k]
    vd = [dequantize(*quantize_int8(v), torch.float32) for v in dense_v]
    torch.testing.assert_close(out, reference(q, qd, vd, q_lens, kv_lens, g, scale), atol=2e-5, rtol=1e-4)
    full = reference(q, dense_k, dense_v, q_lens, kv_lens, g, scale)
    assert (out - full).abs().max() < 0.03


def test_kv_dtype_options():
    assert EngineOptions(kv_dtype="int8").cache_dtype(torch.device("cpu")) == kv_dtype_of("int8")
    assert EngineOptions().cache_dtype(torch.device("cpu")).name == "fp32"
    assert EngineOptions(kv_dtype="bfloat16").cache_dtype(torch.device("cpu")).name == "bf16"
    with pytest.raises(ConfigError, match="--kv-dtype must be one of auto, fp32, fp16, bf16, int8, fp8"):
        EngineOptions(kv_dtype="int3")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="fp8 is not available: the CPU has no fp8"):
            EngineOptions(kv_dtype="fp8")


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

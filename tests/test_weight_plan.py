"""The weight plan (kvcli/model/weight_plan.py): one decision per weight, made from the weights' forms, the
device and the CPU's capabilities, for machines this test is not on (CpuCapabilities and Native built by
hand), and the model built exactly as planned."""

from __future__ import annotations

import pytest
from dataclasses import replace

import torch

from kvcli.config import ModelConfig
from kvcli.model.quant import QuantTensor, random_q4
from kvcli.model.weight_plan import (GEMM_F32_MIN_ROWS, INT8_GEMM_BLOCK32_MIN_ROWS, INT8_GEMM_BLOCK32_MIN_ROWS_VNNI,
                                     INT8_GEMM_MIN_ROWS,
                                     INT8DOT_AMX_MIN_ROWS, INT8DOT_DENSE_MIN_ROWS, Native, TileRule, choose_tier,
                                     int8dot_tiles, plan_linear, plan_model)
from kvcli.native.capabilities import CpuCapabilities, amx_int8_for, build_isa_for, native_bf16_for

AVX2 = CpuCapabilities("an AVX2 CPU", "x86_64", frozenset({"avx2", "fma", "f16c"}), "AVX2", "avx2", False)
BF16 = CpuCapabilities("an AVX-512-BF16 CPU", "x86_64",
                       frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                                  "avx512_bf16"}), "AVX512", "avx512vnni", True)
NATIVE = Native(int8dot=True, rmsnorm=True, swiglu=True, decode_layers=True, build_isa="avx2")
NO_NATIVE = Native()
CPU = torch.device("cpu")


def q4(n: int, k: int = 64, seed: int = 0, group: int = 32) -> QuantTensor:
    return random_q4(n, k, 0.02, torch.Generator().manual_seed(seed), group)


def q8(n: int, k: int = 64) -> QuantTensor:
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    return QuantTensor("q8", codes, torch.full((n, k // 32), 0.01).half(), None, 32)


def tiny_config(**kw) -> ModelConfig:
    base = dict(name="tiny", architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=128, rope_theta=10000.0,
                rms_norm_eps=1e-5, tie_word_embeddings=True)
    base.update(kw)
    return ModelConfig(**base)


def tiny_weights(c: ModelConfig, v_proj=None) -> dict:
    w: dict = {"model.embed_tokens.weight": q8(c.vocab_size, c.hidden_size), "model.norm.weight": torch.ones(c.hidden_size)}
    kv = c.num_kv_heads * c.head_dim
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = q4(c.num_heads * c.head_dim, c.hidden_size, i)
        w[p + "self_attn.k_proj.weight"] = q4(kv, c.hidden_size, i + 10)
        w[p + "self_attn.v_proj.weight"] = v_proj(kv, c.hidden_size) if v_proj else q4(kv, c.hidden_size, i + 20)
        w[p + "self_attn.o_proj.weight"] = q4(c.hidden_size, c.num_heads * c.head_dim, i + 30)
        w[p + "mlp.gate_proj.weight"] = q4(c.intermediate_size, c.hidden_size, i + 40)
        w[p + "mlp.up_proj.weight"] = q4(c.intermediate_size, c.hidden_size, i + 50)
        w[p + "mlp.down_proj.weight"] = q4(c.hidden_size, c.intermediate_size, i + 60)
        w[p + "input_layernorm.weight"] = torch.ones(c.hidden_size)
        w[p + "post_attention_layernorm.weight"] = torch.ones(c.hidden_size)
    return w


def test_capabilities_decide_the_build_and_bf16_from_flags():
    assert build_isa_for("x86_64", BF16.flags, "AVX512") == "avx512vnni"
    assert build_isa_for("x86_64", BF16.flags, "AVX2") == "avx2"  # torch held to AVX2: the AVX2 build
    assert build_isa_for("aarch64", BF16.flags, "AVX512") == "generic"
    assert build_isa_for("x86_64", frozenset({"sse4_2"}), "DEFAULT") == "generic"
    assert native_bf16_for(BF16.flags, "AVX512") and not native_bf16_for(AVX2.flags, "AVX2")
    assert not native_bf16_for(BF16.flags, "AVX512", onednn_max_isa="AVX2")
    assert AVX2.fp32_gemm_preferred and not BF16.fp32_gemm_preferred
    amx = BF16.flags | {"amx_tile", "amx_int8"}
    assert amx_int8_for(amx, "avx512vnni") and not amx_int8_for(BF16.flags, "avx512vnni")
    assert not amx_int8_for(amx, "avx2")  # the tile path's epilogue is AVX-512: the VNNI build only
    assert not amx_int8_for(amx, "avx512vnni", switch="0")  # KVCLI_AMX=0
    assert int8dot_tiles(replace(BF16, amx_int8=True)).min_rows == INT8DOT_AMX_MIN_ROWS and int8dot_tiles(BF16) is None


def test_a_linear_takes_the_best_form_its_tier_has_for_it():
    w = q4(64)
    cpu = plan_linear(w, "cpu", torch.float32, AVX2, NATIVE)
    assert cpu.form == "int8dot-cpu" and cpu.route.dense_min_rows == GEMM_F32_MIN_ROWS and cpu.route.gemm == "fp32-gemm"
    fast = plan_linear(w, "cpu", torch.float32, BF16, NATIVE)
    assert fast.route == fast.route.__class__(INT8DOT_DENSE_MIN_ROWS, "read-back", torch.bfloat16,
                                              INT8_GEMM_BLOCK32_MIN_ROWS_VNNI, one_level=True)
    # 4-bit codes: the int8 GEMM on both ISAs, in plain groups of 32 (Q4_0 / Q4_1: llama.cpp rounds their
    # activations per 32 too) from 32 rows on AVX2 and 9 on AVX-512-VNNI, with the small-row kernel rounding them
    # the same way below (one_level); from 256 in the other forms (Q4_K's sub-scales, zero points, wider groups),
    # which keep two levels below
    assert cpu.route.int8_min_rows == INT8_GEMM_BLOCK32_MIN_ROWS and cpu.route.one_level
    for other in (replace(w, sub_scale=torch.ones_like(w.scale, dtype=torch.uint8)),
                  replace(w, min=None, zero=torch.zeros_like(w.scale, dtype=torch.uint8)), q4(64, k=128, group=64)):
        route = plan_linear(other, "cpu", torch.float32, BF16, NATIVE).route
        assert route.int8_min_rows == INT8_GEMM_MIN_ROWS and not route.one_level
    wide = plan_linear(q8(64), "cpu", torch.float32, BF16, NATIVE)  # 8-bit codes: never (maddubs would saturate)
    assert wide.route == wide.route.__class__(INT8DOT_DENSE_MIN_ROWS, "read-back", torch.bfloat16)
    # AMX: from 256 rows the bf16 GEMM on tiles, faster there than the int8 GEMM; below it the forms rounded per 32
    # take the int8 GEMM and one level, as elsewhere, the others two levels (on int8 tiles)
    amx = replace(BF16, amx_bf16=True)
    route = plan_linear(w, "cpu", torch.float32, amx, NATIVE).route
    assert route == route.__class__(INT8DOT_DENSE_MIN_ROWS, "amx-bf16-gemm", torch.bfloat16,
                                    INT8_GEMM_BLOCK32_MIN_ROWS_VNNI, one_level=True, dense_over_int8=True)
    assert [route.takes_int8(r) for r in (INT8_GEMM_BLOCK32_MIN_ROWS_VNNI - 1, INT8_GEMM_BLOCK32_MIN_ROWS_VNNI,
                                          INT8DOT_DENSE_MIN_ROWS - 1, INT8DOT_DENSE_MIN_ROWS)] == [False, True, True, False]
    assert route.first_float_rows == INT8DOT_DENSE_MIN_ROWS  # the one-call C decode stops below it
    assert not fast.route.dense_over_int8 and fast.route.first_float_rows is None  # elsewhere: the int8 GEMM
    for other in (q4(64, k=128, group=64), q8(64)):
        assert plan_linear(other, "cpu", torch.float32, amx, NATIVE).route == route.__class__(
            INT8DOT_DENSE_MIN_ROWS, "amx-bf16-gemm", torch.bfloat16)
    invariant = plan_linear(w, "cpu", torch.float32, BF16, NATIVE, row_invariant=True).route
    assert invariant.dense_min_rows is None and not invariant.one_level
    # without kvcli's kernel: torch's int4 kernel, and its exact fallback where rows are not a multiple of 16
    assert plan_linear(w, "cpu", torch.float32, AVX2, NO_NATIVE).form == "int4-cpu"
    assert plan_linear(q4(24), "cpu", torch.float32, AVX2, NO_NATIVE).form == "dequant-torch"
    assert plan_linear(q8(32), "cpu", torch.float32, AVX2, NO_NATIVE).form == "int4x2-cpu"
    # a fused weight is planned by its fused rows: two parts of 8 rows take torch's kernel together
    assert plan_linear(q4(8), "int4-cpu", torch.float32, AVX2, NO_NATIVE, rows=16).form == "int4-cpu"
    assert plan_linear(q4(8), "int4-cpu", torch.float32, AVX2, NO_NATIVE).form == "dequant-torch"
    assert plan_linear(w, "triton", torch.float16, AVX2, NO_NATIVE).form == "triton"
    assert plan_linear(q8(32), "triton", torch.float16, AVX2, NO_NATIVE).form == "triton-int8"
    assert plan_linear(w, "exact", torch.float16, AVX2, NO_NATIVE).form == "dequant-torch"
    assert plan_linear(w, "dense", torch.float32, AVX2, NATIVE).form == "dense"
    half = torch.zeros(64, 64, dtype=torch.float16)
    assert plan_linear(half, "cpu", torch.float32, AVX2, NATIVE).form == "half-torch"
    assert plan_linear(half, "dense", torch.float32, AVX2, NATIVE).form == "dense"
    with pytest.raises(ValueError, match="unknown weight tier"):
        plan_linear(w, "int4-torch", torch.float32, AVX2, NATIVE)


def test_the_tier_follows_the_file_the_flags_and_the_device():
    c = tiny_config()
    w = tiny_weights(c)
    kw = dict(gguf_file=True, dense_linears=None, device=CPU, backend="torch", dtype=torch.float32)
    assert choose_tier(w, dequantize=False, **kw) == ("cpu", torch.bfloat16)
    assert choose_tier(w, dequantize=True, **kw) == ("dense", torch.float32)
    gpu = dict(kw, device=torch.device("cuda"), dtype=torch.float16)
    assert choose_tier(w, dequantize=False, **dict(gpu, backend="triton"))[0] == "triton"
    assert choose_tier(w, dequantize=False, **gpu)[0] == "exact"
    dense = {k: (v.dequantize() if isinstance(v, QuantTensor) else v) for k, v in w.items()}
    assert choose_tier(dense, dequantize=False, **kw) == ("dense", torch.float32)


def test_a_model_plan_fuses_layouts_routes_rows_and_decides_the_one_call_decode():
    c = tiny_config()
    plan = plan_model(c, tiny_weights(c), tier="cpu", dtype=torch.float32, device=CPU, head_dtype=torch.bfloat16,
                      caps=AVX2, native=NATIVE)
    qkv = plan.layers[0][0]
    assert qkv.name == "qkv" and not qkv.grouped and len(qkv.parts[0].names) == 3
    assert plan.forms() == "int8dot-cpu" and plan.head.form == "int8dot-cpu" and plan.head.tied
    # the C loop follows the int8 GEMM's route (4-bit codes in groups of 32 take it from 32 rows), not a float GEMM's
    assert plan.native_decode and plan.native_decode_max_rows is None
    assert plan.by_projection()["v_proj"] == {"int8dot-cpu": 2}
    # Q4_K_M-like: v in another layout -> q/k fused, v its own part (a group); still one C call, for steps under the
    # rows from which the 8-bit part takes the fp32 GEMM
    mixed = plan_model(c, tiny_weights(c, v_proj=lambda n, k: q8(n, k)), tier="cpu", dtype=torch.float32, device=CPU,
                       head_dtype=torch.bfloat16, caps=AVX2, native=NATIVE)
    assert [len(p.names) for p in mixed.layers[0][0].parts] == [2, 1] and mixed.native_decode
    assert mixed.native_decode_max_rows == GEMM_F32_MIN_ROWS and f"under {GEMM_F32_MIN_ROWS} rows" in mixed.native_decode_why
    # without kvcli's kernels: torch's int4 tier, a bf16 dense vocabulary table, layer by layer
    slow = plan_model(c, tiny_weights(c), tier="cpu", dtype=torch.float32, device=CPU, head_dtype=torch.bfloat16,
                      caps=AVX2, native=NO_NATIVE)
    assert slow.forms() == "int4-cpu" and slow.head.form == "dense" and slow.head.fp32_slices
    assert not slow.native_decode and "not available" in slow.native_decode_why
    # a bias on q/k/v (Qwen2's) the C loop adds after the projection: still one C call
    biased = plan_model(tiny_config(attention_bias=True), tiny_weights(c), tier="cpu", dtype=torch.float32, device=CPU,
                        head_dtype=torch.bfloat16, caps=AVX2, native=NATIVE)
    assert biased.layers[0][0].bias and biased.native_decode
    # row invariance: no route anywhere
    inv = plan_model(c, tiny_weights(c), tier="cpu", dtype=torch.float32, device=CPU, head_dtype=torch.bfloat16,
                     caps=AVX2, native=NATIVE, row_invariant=True)
    assert not inv.has_row_routes and plan.has_row_routes and inv.native_decode_max_rows is None
    # AMX tiles where the library turned them on: said by inspect, for kvcli's int8 kernel only
    tiles = plan_model(c, tiny_weights(c), tier="cpu", dtype=torch.float32, device=CPU, head_dtype=torch.bfloat16,
                       caps=BF16, native=replace(NATIVE, int8_tiles=TileRule(6, 4096, 3)))
    assert tiles.int8_tiles == TileRule(6, 4096, 3)
    assert "AMX tiles from 6 rows and 4096 activations" in dict(tiles.describe())["int8 tiles"]
    assert plan.int8_tiles is None
    assert plan_model(c, tiny_weights(c), tier="cpu", dtype=torch.float32, device=CPU, head_dtype=torch.bfloat16,
                      caps=BF16, native=replace(NO_NATIVE, int8_tiles=TileRule(6, 4096, 3))).int8_tiles is None  # int4


def test_the_model_is_built_as_planned():
    from kvcli.model.llama import LlamaModel
    from kvcli.native import registry

    if registry.library("int8dot") is None:
        pytest.skip(f"kvcli's kernel: {registry.unavailable('int8dot')}")
    c = tiny_config()
    w = tiny_weights(c, v_proj=lambda n, k: q8(n, k))
    plan = plan_model(c, w, tier="cpu", dtype=torch.float32, device=CPU, head_dtype=torch.bfloat16,
                      caps=AVX2, native=Native.here(CPU, torch.float32))
    model = LlamaModel(c, dict(w), plan=plan, device=CPU)
    assert [lin.mode for lin in model.linears()] == [p.form for p in plan.linears()]
    assert all(lin.kernel.dense_min_rows == GEMM_F32_MIN_ROWS for lin in model.linears())
    assert model.lm_head.path == plan.head.describe() and model.linear_mode == "int8dot-cpu"
    assert (model.native_decode is not None) == plan.native_decode

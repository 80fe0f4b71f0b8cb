"""Every kvcli internal a benchmark reaches into, in one table: the kernel micro-benchmarks and the KV and
attention figures time pieces below the public surface (kvcli.llm.LLM, kvcli.engine.llm_engine.LLMEngine,
kvcli.options.EngineOptions, kvcli.model.loader). When one of these moves, fix it here; the figures import
them from this module (`from kvcli.bench.internals import Int8DotCpu`), resolved at first use.
tests/test_bench_package.py checks that every name still resolves."""

from __future__ import annotations

import importlib

WHERE: dict[str, str] = {  # name -> "module:attribute", or "module" for a module itself
    # int8dot-ops: the CPU linear kernels, one against another
    "Int4Cpu": "kvcli.model.int4_cpu:Int4Cpu",
    "Int8DotCpu": "kvcli.model.int8dot_cpu:Int8DotCpu",
    "native_library": "kvcli.model.int8dot_cpu:native_library",
    "tile_rule": "kvcli.model.int8dot_cpu:tile_rule",
    "restore_tiles": "kvcli.model.int8dot_cpu:restore_tiles",
    "RowRoute": "kvcli.model.row_route:RowRoute",
    "QuantTensor": "kvcli.model.quant:QuantTensor",
    "quantize_q4": "kvcli.model.quant:quantize_q4",
    # kv-attention, prefill-attention, kv-int4: the torch attention backend and the KV pool's layer views
    "AttentionMetadata": "kvcli.attention.base:AttentionMetadata",
    "TorchAttentionBackend": "kvcli.attention.torch_backend:TorchAttentionBackend",
    "attend": "kvcli.attention.torch_backend:attend",
    "native_attention": "kvcli.attention.torch_backend:native_attention",
    "native_prefill_attention": "kvcli.attention.torch_backend:native_prefill_attention",
    "LayerKV": "kvcli.kvcache.kv_cache:LayerKV",
    "kv_dtype_of": "kvcli.kvcache.kv_dtype:kv_dtype_of",
    "kv_dtype": "kvcli.kvcache.kv_dtype",
    "quantize": "kvcli.kvcache.kv_dtype:quantize",
    # (build: the KV formats' table, kv_dtype.KV_DTYPES: their decode-attention loops are built on first need)
    # kv-dtype, kv-int4: teacher-forced perplexity through the engine
    "perplexity": "kvcli.engine.perplexity:perplexity",
    # weight-tiers: a model built under another weight tier than the engine would pick
    "LlamaModel": "kvcli.model.llama:LlamaModel",
    "Native": "kvcli.model.weight_plan:Native",
    "plan_loaded": "kvcli.model.weight_plan:plan_loaded",
    "plan_model": "kvcli.model.weight_plan:plan_model",
    # folder-quant: a text as the model reads it from its start (its file's BOS first)
    "document_ids": "kvcli.model.tokenizer:document_ids",
    # kquants, hf-quant: kvcli's own encoders of the files they measure
    "kquant_encode": "kvcli.model.kquant_encode",
    "hf_quant_encode": "kvcli.model.hf_quant_encode",
}


def __getattr__(name: str):
    if name not in WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, _, attr = WHERE[name].partition(":")
    return getattr(importlib.import_module(module), attr) if attr else importlib.import_module(module)

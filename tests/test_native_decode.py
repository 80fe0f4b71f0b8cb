"""Decode steps through every layer in one C call (kvcli/model/native_decode.py, kernels/cpu_decode_layers.c)
against the layer-by-layer path on the bundled model and a K-quant one: the same kernels in the same order, so every
step's logits and the whole KV cache must be equal bit for bit. Ragged requests decoding side by side,
each KV dtype the C loop writes (int8 / fp8 with their scales); and the steps it must leave to the
layer-by-layer path (prefill chunks, the row-invariant backend)."""

from __future__ import annotations

import pytest
import torch

from kvcli.config import SamplingParams
from kvcli.engine.llm_engine import EngineOptions, LLMEngine
from kvcli.model.loader import load_weights

pytestmark = pytest.mark.slow
PROMPTS = ("The keeper climbed the stairs to the lamp room and",
           "Once upon a time, in a lighthouse at the end of a long and narrow road by the sea, there lived",
           "Fog")


def _load(path) -> tuple:
    loaded = load_weights(path)
    engine = LLMEngine(loaded, EngineOptions(kv_budget="32MiB", max_model_len=512))
    if engine.model.native_decode is None:
        pytest.skip("kvcli's C kernels do not all build here (or KVCLI_NATIVE=0)")
    return loaded, engine.model


@pytest.fixture(scope="module")
def shared():
    return _load(None)


@pytest.fixture(scope="module")
def kquant(tiny_kquant):
    """Q4_K_M-like layer 0 (q/k Q4_K + v Q6_K), layer 1 with q/k/v and gate/up of mixed 5/8-bit types:
    LinearGroups of two and three parts."""
    return _load(str(tiny_kquant))


@pytest.fixture(scope="module")
def kquant_qwen3(tmp_path_factory):
    """The same K-quant layers as a Qwen3: per-head q/k RMSNorms before the rotary."""
    from kquant_model import write_tiny_kquant_gguf

    return _load(str(write_tiny_kquant_gguf(tmp_path_factory.mktemp("kq3") / "tiny-qwen3.gguf", arch="qwen3")))


@pytest.fixture(scope="module")
def kquant_qwen2(tmp_path_factory):
    """The same K-quant layers as a Qwen2: q/k/v biases."""
    from kquant_model import write_tiny_kquant_gguf

    return _load(str(write_tiny_kquant_gguf(tmp_path_factory.mktemp("kq2") / "tiny-qwen2.gguf", arch="qwen2")))


@pytest.fixture(scope="module")
def kquant_gemma3(tmp_path_factory):
    """The same K-quant layers as a Gemma 3: q/k norms, norms after attention and MLP, GeGLU, scaled
    embeddings, layer 0 sliding over 8 tokens with its own rotary base, layer 1 global."""
    from kquant_model import write_tiny_kquant_gguf

    return _load(str(write_tiny_kquant_gguf(tmp_path_factory.mktemp("kg3") / "tiny-gemma3.gguf", arch="gemma3")))


@pytest.fixture(scope="module")
def kquant_gemma2(tmp_path_factory):
    """The same K-quant layers as a Gemma 2: sandwich norms, GeGLU, layer 0 sliding over 8 tokens, attention
    scores and logits soft-capped."""
    from kquant_model import write_tiny_kquant_gguf

    return _load(str(write_tiny_kquant_gguf(tmp_path_factory.mktemp("kg2") / "tiny-gemma2.gguf", arch="gemma2")))


class Head:
    """The model's vocabulary projection, recording every output."""

    def __init__(self, head, logits: list) -> None:
        self.head, self.logits = head, logits

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        out = self.head(h)
        self.logits.append(out.clone())
        return out

    def __getattr__(self, name: str):
        return getattr(self.head, name)


class Recorder:
    """Stands in for the model's vocabulary projection and the C loop, recording what they did."""

    def __init__(self, model) -> None:
        self.native = model.native_decode
        self.logits: list[torch.Tensor] = []
        self.lm_head = Head(model.lm_head, self.logits)
        self.native_steps = self.native_declined = 0

    def native_decode(self, *args) -> bool:
        took = self.native(*args)
        self.native_steps += took
        self.native_declined += not took
        return took


def _run(shared, monkeypatch, native: bool, backend: str = "auto", **opts) -> tuple[Recorder, LLMEngine]:
    loaded, model = shared
    rec = Recorder(model)
    with monkeypatch.context() as m:
        m.setattr(model, "lm_head", rec.lm_head)
        m.setattr(model, "native_decode", rec.native_decode if native else None)
        engine = LLMEngine(loaded, EngineOptions(kv_budget="32MiB", max_model_len=512, attention_backend=backend,
                                                 **opts), model=model)
        for layer in engine.kv_cache.layers:  # unused blocks hold whatever memory the pool got
            for t in layer.tensors():
                t.zero_()
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        for p in PROMPTS:
            engine.add_request(engine.tokenizer.encode(p), params)
        while engine.has_unfinished():
            engine.step()
    return rec, engine


@pytest.mark.parametrize("kv", ["fp16", "fp32", "bf16", "int8", "fp8"])
def test_logits_and_cache_equal_the_layer_by_layer_path_bitwise(shared, monkeypatch, kv):
    native, eng_a = _run(shared, monkeypatch, True, kv_dtype=kv)
    layers, eng_b = _run(shared, monkeypatch, False, kv_dtype=kv)
    assert native.native_steps >= 10  # the decode steps went through the C loop
    assert native.native_declined >= 1  # the prefill step did not
    assert len(native.logits) == len(layers.logits)
    for a, b in zip(native.logits, layers.logits):
        assert torch.equal(a, b)
    for la, lb in zip(eng_a.kv_cache.layers, eng_b.kv_cache.layers):
        assert len(la.tensors()) == (4 if kv in ("int8", "fp8") else 2)  # codes and their scales
        for ta, tb in zip(la.tensors(), lb.tensors()):
            raw = torch.uint8 if ta.dtype == torch.float8_e4m3fn else ta.dtype
            assert torch.equal(ta.view(raw), tb.view(raw))


def test_linear_groups_of_mixed_forms_equal_the_layer_by_layer_path_bitwise(kquant, monkeypatch):
    """Each part of a LinearGroup writes its columns of the fused output: the same values as the layer
    path's concatenation."""
    from kvcli.model.layers import LinearGroup

    model = kquant[1]
    sizes = sorted({len(lin.parts) for layer in model.layers for lin in (layer.qkv, layer.gate_up)
                    if isinstance(lin, LinearGroup)})
    assert sizes == [2, 3]
    native, eng_a = _run(kquant, monkeypatch, True)
    layers, eng_b = _run(kquant, monkeypatch, False)
    assert native.native_steps >= 10 and len(native.logits) == len(layers.logits)
    for a, b in zip(native.logits, layers.logits):
        assert torch.equal(a, b)
    for la, lb in zip(eng_a.kv_cache.layers, eng_b.kv_cache.layers):
        assert torch.equal(la.k, lb.k) and torch.equal(la.v, lb.v)


def _c_loop_equals_the_layers(shared, monkeypatch) -> Recorder:
    """Decode through the C loop and layer by layer: the same logits and KV cache bit for bit. The layer path's
    record."""
    native, eng_a = _run(shared, monkeypatch, True)
    layers, eng_b = _run(shared, monkeypatch, False)
    assert native.native_steps >= 10 and len(native.logits) == len(layers.logits)
    for a, b in zip(native.logits, layers.logits):
        assert torch.equal(a, b)
    for la, lb in zip(eng_a.kv_cache.layers, eng_b.kv_cache.layers):
        assert torch.equal(la.k, lb.k) and torch.equal(la.v, lb.v)
    return layers


def _without_it_logits_differ(shared, monkeypatch, layers: Recorder, **stripped) -> None:
    """The check has teeth: the C loop with `stripped` fields of every layer's description set as given (a
    piece of the layer left out) gives logits other than the layer path's."""
    import dataclasses

    model = shared[1]
    desc = model.native_decode.desc
    model.native_decode.desc = dataclasses.replace(
        desc, layers=tuple(dataclasses.replace(l, **stripped) for l in desc.layers))
    model.native_decode._plans.clear()
    try:
        skipped, _ = _run(shared, monkeypatch, True)
    finally:
        model.native_decode.desc = desc
        model.native_decode._plans.clear()
    assert skipped.native_steps >= 10
    assert not all(torch.equal(a, b) for a, b in zip(skipped.logits, layers.logits))


def test_qwen3_qk_norms_in_the_c_loop_equal_the_layer_path_bitwise(kquant_qwen3, monkeypatch):
    """The C loop norms every q and k head in place before the rotary, as LlamaModel._qk_norm does; with the
    norms skipped in C the logits differ (the check has teeth)."""
    model = kquant_qwen3[1]
    assert model.config.qk_norm and model.native_decode is not None
    layers = _c_loop_equals_the_layers(kquant_qwen3, monkeypatch)
    _without_it_logits_differ(kquant_qwen3, monkeypatch, layers, q_norm=None, k_norm=None)


def test_qwen2_biases_in_the_c_loop_equal_the_layer_path_bitwise(kquant_qwen2, monkeypatch):
    """The C loop adds Qwen2's q/k/v biases after the projection, as Linear does; without them the logits differ
    (the check has teeth)."""
    model = kquant_qwen2[1]
    assert model.config.attention_bias and model.native_decode is not None
    layers = _c_loop_equals_the_layers(kquant_qwen2, monkeypatch)
    _without_it_logits_differ(kquant_qwen2, monkeypatch, layers, qkv_bias=None)


def test_gemma3_layers_in_the_c_loop_equal_the_layer_path_bitwise(kquant_gemma3, monkeypatch):
    """Per-layer windows (an attention step per window), per-layer rotary tables, the sandwich norms and GeGLU
    in the C loop: logits and KV cache the layer path's bit for bit, on prompts longer than the window."""
    model = kquant_gemma3[1]
    c = model.config
    assert c.layer_types == ("sliding", "full") and c.local_window == 8 and model.native_decode is not None
    _c_loop_equals_the_layers(kquant_gemma3, monkeypatch)


def test_gemma2_softcapped_attention_in_the_c_loop_equals_the_layer_path_bitwise(kquant_gemma2, monkeypatch):
    """The attention soft-cap rides the C loop's attention steps: logits and KV cache the layer path's bit for
    bit; and the cap is computed (the loop without it gives other logits)."""
    from dataclasses import replace

    model = kquant_gemma2[1]
    c = model.config
    assert c.attn_logit_softcap == 1.0 and c.layer_types == ("sliding", "full") and model.native_decode is not None
    layers = _c_loop_equals_the_layers(kquant_gemma2, monkeypatch)
    model.config = replace(c, attn_logit_softcap=None)
    try:
        uncapped, _ = _run(kquant_gemma2, monkeypatch, True)
    finally:
        model.config = c
    assert not all(torch.equal(a, b) for a, b in zip(uncapped.logits, layers.logits))


def test_steps_it_leaves_to_the_layers(shared, monkeypatch):
    # its own row-invariant attention, over a model planned for it (a shared model keeps its plan)
    loaded = load_weights(None)
    planned = LLMEngine(loaded, EngineOptions(kv_budget="32MiB", max_model_len=512, attention_backend="invariant"))
    rec, _ = _run((loaded, planned.model), monkeypatch, True, backend="invariant")
    assert rec.native_steps == 0 and rec.native_declined > 0


def test_a_bad_position_is_an_error_not_a_write(shared):
    """Positions past the rotary table stop the C loop before it writes (the kernel validates first)."""
    loaded, model = shared
    engine = LLMEngine(loaded, EngineOptions(kv_budget="32MiB", max_model_len=512), model=model)
    engine.add_request(engine.tokenizer.encode(PROMPTS[0]), SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()  # prefill
    seen = {}
    real = model.native_decode

    def bad(h, positions, kv_cache, meta, backend):
        seen["cache"] = [l.k.clone() for l in kv_cache.layers[:1]]
        return real(h, positions + model.rotary.cos.shape[0], kv_cache, meta, backend)

    model.native_decode = bad
    try:
        with pytest.raises(RuntimeError, match="layer 0: rotary / KV store"):
            engine.step()
    finally:
        model.native_decode = real
    bits = torch.int16 if seen["cache"][0].element_size() == 2 else torch.int32  # the pool may hold NaN garbage
    assert torch.equal(seen["cache"][0].view(bits), engine.kv_cache.layers[0].k.view(bits))


def test_verification_steps_run_in_the_c_loop_as_plain_decode_steps(shared, monkeypatch):
    """Speculative verification steps (1 + k rows per request) go through the C loop, each row a decode query of
    its own length over the request's block table: every row whose prefix is the true text has plain decode's
    logits for that position bit for bit (contexts under 256 keys, which the kernel does not split into spans;
    the layer-by-layer path computes the rows as a prefill chunk, whose own keys are not yet rounded to the
    fp16 cache: ~1e-3 apart)."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    loaded, model = shared
    text = "one two three four five six seven eight. one two three four five six seven eight. one two three"

    def run(native: bool, speculate: str):
        rec = Recorder(model)
        rows: list[int] = []
        emitted: list[int] = []

        def counted(h, *args):
            took = rec.native_decode(h, *args)
            if took:
                rows.append(h.shape[0])
            return took

        with monkeypatch.context() as m:
            m.setattr(model, "lm_head", rec.lm_head)
            m.setattr(model, "native_decode", counted if native else None)
            engine = LLMEngine(loaded, EngineOptions(kv_budget="32MiB", max_model_len=512, speculate=speculate,
                                                     num_speculative_tokens=5), model=model)
            engine.add_request(engine.tokenizer.encode(text), params)
            while engine.has_unfinished():
                emitted.append(sum(len(out.new_token_ids) for out in engine.step()))
        return rec, emitted, rows

    spec, spec_emitted, spec_rows = run(True, "ngram")
    plain, plain_emitted, _ = run(True, "none")
    _, layer_emitted, _ = run(False, "ngram")
    assert max(spec_emitted) > 1 and max(spec_rows) > 1  # guesses were accepted, verification steps ran in C
    assert len(spec.logits) == len(spec_emitted) and all(e == 1 for e in plain_emitted)
    done = 0
    for logits, e in zip(spec.logits, spec_emitted):  # a step's first e rows predict tokens done .. done + e - 1
        for j in range(e):
            assert torch.equal(logits[j], plain.logits[done + j].reshape(-1)), (done, j)
        done += e
    assert done == 24 and len(layer_emitted) == len(spec_emitted)

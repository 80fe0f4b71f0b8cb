"""Model loading: GGUF tensors bit-identical to transformers' dequantization, Hugging Face
checkpoint folders (llama, qwen2 with qkv bias, mistral) exact against transformers, quantized
variants, and dummy presets."""

from __future__ import annotations

import json

import pytest
import torch

from cpu_paths import cpu_mode

from kvcli.config import PRESETS, SamplingParams, preset_config
from kvcli.llm import LLM
from kvcli.model.gguf_loader import load_gguf
from kvcli.model.quant import QuantTensor


@pytest.mark.slow
def test_gguf_weights_bit_identical_to_transformers(gguf_path, hf_model):
    config, weights, types = load_gguf(gguf_path)
    assert types == {"Q8_0": 1, "F32": 61, "Q4_1": 210}
    sd = hf_model.state_dict()
    for name in ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.7.self_attn.k_proj.weight", "model.layers.29.mlp.down_proj.weight",
                 "model.layers.3.input_layernorm.weight"]:
        w = weights[name]
        dense = w.dequantize() if isinstance(w, QuantTensor) else w
        assert torch.equal(dense, sd[name]), name
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, QuantTensor) and q.codes.dtype == torch.uint8 and q.codes.shape == (576, 288)


TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
            rope_theta=10000.0, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory, gguf_path):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tok")
    AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(str(d))
    return d


def make_checkpoint(tmp_path, tokenizer_files, arch: str, dtype=torch.float32, **shape):
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(arch, **{**TINY, **shape})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
    with torch.no_grad():  # non-trivial norms and biases so that every weight matters
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    out = tmp_path / arch
    model.save_pretrained(str(out))
    for f in tokenizer_files.iterdir():
        shutil.copy(f, out / f.name)
    return out, model


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_checkpoint_folder_exact(tmp_path, tokenizer_files, arch):
    path, ref = make_checkpoint(tmp_path, tokenizer_files, arch)
    llm = LLM(str(path), quant="none", kv_budget="16MiB", block_size=16, max_num_batched_tokens=40)
    assert llm.engine.config.architecture == arch
    assert llm.engine.config.attention_bias == (arch == "qwen2")
    ids = list(range(100, 190))
    got = logits_through_engine(llm.engine, ids, chunk=40)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    assert (got - want).abs().max().item() < 1e-4
    # Random tiny models have nearly flat logits, so free-running greedy only checks a few tokens.
    out = llm.generate([ids[:37]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    seq = ids[:37]
    with torch.no_grad():
        for _ in range(4):
            seq.append(int(ref(torch.tensor([seq])).logits[0, -1].argmax()))
    assert out.token_ids == seq[37:]


def logits_through_engine(engine, ids: list[int], chunk: int) -> torch.Tensor:
    from kvcli.step import ScheduledChunk, SchedulerOutput

    rows = []
    for pos in range(0, len(ids), chunk):
        part = ids[pos:pos + chunk]
        assert engine.kv.allocate("x", pos + len(part), pos)
        step = SchedulerOutput([ScheduledChunk("x", part, pos, engine.kv.block_table("x"), True)])
        rows.append(engine.runner.execute(step, all_logits=True).logits)
    engine.kv.free("x")
    return torch.cat(rows)


@pytest.mark.slow
def test_checkpoint_quantized_int4_and_nf4(tmp_path, tokenizer_files):
    path, ref = make_checkpoint(tmp_path, tokenizer_files, "llama", torch.float16)
    ids = list(range(300, 364))
    with torch.no_grad():
        want = ref.float()(torch.tensor([ids])).logits[0, -1]
    for quant, mode in [("int4", cpu_mode("int4-cpu")), ("nf4", "nf4")]:
        if quant == "nf4":
            pytest.importorskip("bitsandbytes")
        llm = LLM(str(path), quant=quant, kv_budget="16MiB")
        assert llm.engine.linear_mode == mode
        wb = llm.engine.weight_bytes()["layers"]
        dense = sum(p.numel() * 2 for n, p in ref.named_parameters() if "layers" in n and "proj" in n)
        assert wb < dense / 2.5, f"{quant}: {wb} layer bytes vs {dense} in fp16"
        out = llm.generate([ids], SamplingParams(max_tokens=1))[0]
        assert out.token_ids and 0 <= out.token_ids[0] < 49152
        # 4-bit weights of random matrices: the logits stay strongly correlated with the fp16 model's.
        got = logits_through_engine(llm.engine, ids, chunk=64)[-1]
        corr = torch.corrcoef(torch.stack([got, want]))[0, 1].item()
        assert corr > 0.9, f"{quant}: correlation {corr:.3f}"


@pytest.mark.slow
def test_int4_keeps_a_linear_dense_whose_width_is_not_a_multiple_of_its_group(tmp_path, tokenizer_files):
    """An intermediate size of 176 (and o_proj's 7 x 112 = 784 on a Mistral-like shape) is no multiple of int4's group
    of 32: the default quantization once stopped the load with a traceback (--dequantize too). Those linears stay
    dense, with a note; the rest are int4; the model runs, its dense down_proj as exact as quant='none'."""
    from kvcli.model.loader import load_weights

    path, ref = make_checkpoint(tmp_path, tokenizer_files, "llama", intermediate_size=176)
    loaded = load_weights(str(path), quant="int4")
    downs = [n for n in loaded.weights if n.endswith("down_proj.weight")]
    assert downs and all(isinstance(loaded.weights[n], torch.Tensor) for n in downs)
    assert all(isinstance(loaded.weights[n], QuantTensor) for n in loaded.weights if n.endswith("up_proj.weight"))
    assert any("kept dense" in note and "down_proj" in note and "176" in note for note in loaded.notes), loaded.notes
    llm = LLM(str(path), quant="int4", kv_budget="16MiB")
    assert "dense" in llm.engine.linear_mode
    ids = list(range(300, 364))
    got = logits_through_engine(llm.engine, ids, chunk=64)[-1]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0, -1]
    assert torch.corrcoef(torch.stack([got, want]))[0, 1].item() > 0.9
    out = llm.generate([ids], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3


def test_checkpoint_errors(tmp_path):
    from kvcli.model.loader import ModelLoadError, load_weights

    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_weights(str(tmp_path / "empty"))
    gpt = tmp_path / "gpt"
    gpt.mkdir()
    (gpt / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        load_weights(str(gpt))


def test_presets_match_published_shapes():
    assert set(PRESETS) >= {"smollm2-135m", "llama-2-7b", "llama-2-13b", "llama-3-8b", "mistral-7b"}
    fp16 = torch.float16
    # KV bytes per token: 2 (K,V) x layers x kv_heads x head_dim x 2 bytes.
    assert preset_config("llama-2-7b").kv_bytes_per_token(fp16) == 2 * 32 * 32 * 128 * 2  # 512 KiB
    assert preset_config("llama-2-13b").kv_bytes_per_token(fp16) == 2 * 40 * 40 * 128 * 2  # 800 KiB
    assert preset_config("llama-3-8b").kv_bytes_per_token(fp16) == 2 * 32 * 8 * 128 * 2  # 128 KiB (GQA)
    assert abs(preset_config("llama-2-7b").num_params() / 6.74e9 - 1) < 0.01
    assert abs(preset_config("llama-3-8b").num_params() / 8.03e9 - 1) < 0.01


def test_dummy_config_file(tmp_path):
    cfg = dict(PRESETS["smollm2-135m"], num_hidden_layers=2)
    f = tmp_path / "tiny.json"
    f.write_text(json.dumps(cfg))
    llm = LLM(f"dummy:{f}", kv_budget="8MiB")
    out = llm.generate(["hello"], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5
    assert llm.engine.config.num_layers == 2 and llm.engine.linear_mode == cpu_mode("int4-cpu")


NO_BNB = ("import sys; sys.modules['bitsandbytes'] = None; "  # importing it now raises ImportError
          "from kvcli.cli import main; main()")


def test_checkpoint_without_bitsandbytes(tmp_path, tokenizer_files):
    """The default --quant (auto) on a Hugging Face folder is kvcli's int4 on a machine without CUDA (no note:
    it is the CPU's default), and falls back to it with a note where CUDA would have taken NF4 but bitsandbytes
    cannot be imported; an explicit --quant nf4 is a one-line error naming the fix."""
    import torch

    import subprocess
    import sys

    path, _ = make_checkpoint(tmp_path, tokenizer_files, "llama")
    text = tmp_path / "in.txt"
    text.write_text("The keeper climbed the stairs")
    argv = [sys.executable, "-c", NO_BNB, "continue", str(text), "--model", str(path), "-n", "2", "--json",
            "--kv-budget", "8MiB"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["weights_format"] == cpu_mode("int4-cpu")
    notes = [ln for ln in p.stderr.splitlines() if ln.startswith("kvcli: note:")]
    if torch.cuda.is_available():
        assert len(notes) == 1 and "bitsandbytes is not installed" in notes[0] and "int4" in notes[0], p.stderr
    else:
        assert notes == [], p.stderr
    assert "Traceback" not in p.stderr
    p = subprocess.run([*argv, "--quant", "nf4"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and p.stdout == "" and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines() == ["kvcli: error: --quant nf4 needs bitsandbytes, which is not "
                                             "installed: pip install bitsandbytes, or use --quant int4"]


# Tiny GGUFs written here: Q4_0 / Q8_0 linears, llama (q/k rows permuted as llama.cpp stores them)
# and qwen2 (qkv bias) -------------------------------------------------------------------------------

GGUF_NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
              "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
              "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
              "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
              "self_attn.v_proj.bias": "attn_v.bias", "mlp.gate_proj.weight": "ffn_gate.weight",
              "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def llama_cpp_permute(w, n_head: int):
    """llama.cpp's convert script: q/k rows interleaved for its rope kernel."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, arch: str, qtype_name: str):
    """A random 2-layer model as a GGUF with quantized linears, and the transformers model holding
    exactly the dequantized weights (the dense reference)."""
    import gguf
    import numpy as np
    from transformers import AutoConfig, AutoModelForCausalLM

    c = dict(TINY, vocab_size=512)
    cfg = AutoConfig.for_model(arch, **c)
    torch.manual_seed(1)
    ref = AutoModelForCausalLM.from_config(cfg).float().eval()
    qtype = getattr(gguf.GGMLQuantizationType, qtype_name)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_vocab_size(c["vocab_size"])
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            if name == "model.embed_tokens.weight":
                gname = "token_embd.weight"
            elif name == "lm_head.weight":
                gname = "output.weight"
            elif name == "model.norm.weight":
                gname = "output_norm.weight"
            else:
                _, _, idx, rest = name.split(".", 3)
                gname = f"blk.{idx}.{GGUF_NAMES[rest]}"
            data = p.detach().numpy().astype(np.float32)
            if p.ndim == 2 and "proj" in name:
                if arch == "llama" and ("q_proj" in name or "k_proj" in name):
                    heads = c["num_attention_heads"] if "q_proj" in name else c["num_key_value_heads"]
                    data = llama_cpp_permute(data, heads)
                q = gguf.quants.quantize(data, qtype)
                w.add_tensor(gname, q, raw_dtype=qtype)
                # Quantization is row-local, so dequantizing the unpermuted weight gives the same rows.
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(
                    p.detach().numpy().astype(np.float32), qtype), qtype)))
            else:
                w.add_tensor(gname, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref


@pytest.mark.parametrize("arch,qtype", [("llama", "Q4_0"), ("llama", "Q8_0"), ("qwen2", "Q4_0")])
def test_tiny_gguf_linears_match_a_dense_reference(tmp_path, arch, qtype):
    from kvcli.engine.llm_engine import EngineOptions, LLMEngine
    from kvcli.model.loader import LoadedWeights
    from kvcli.model.tokenizer import ByteTokenizer

    path = tmp_path / f"tiny-{arch}-{qtype}.gguf"
    ref = write_tiny_gguf(path, arch, qtype)
    config, weights, types = load_gguf(path)
    assert config.architecture == arch and config.attention_bias == (arch == "qwen2")
    assert types[qtype] == 2 * 7 and not config.tie_word_embeddings
    q = weights["model.layers.1.self_attn.k_proj.weight"]
    assert isinstance(q, QuantTensor) and q.kind == {"Q4_0": "q4", "Q8_0": "q8"}[qtype]
    ids = list(range(3, 80))
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    for dequantize in (True, False):
        loaded = LoadedWeights(config, dict(weights), ByteTokenizer(), str(path))  # the model takes them
        engine = LLMEngine(loaded, EngineOptions(kv_budget="4MiB", dequantize=dequantize, max_num_batched_tokens=32))
        got = logits_through_engine(engine, ids, chunk=32)
        if dequantize:  # dense fp32 from the file's codes: the reference's numbers
            assert (got - want).abs().max().item() < 1e-4, (arch, qtype)
        else:  # kvcli's int8dot kernel (two int8 levels per activation: ~15 bits), else torch's int4 CPU
            # kernel (bf16 activations): Q4_0 as 4-bit codes, Q8_0 as two nibbles per code
            mode = cpu_mode("int4-cpu" if qtype == "Q4_0" else "int4x2-cpu")
            assert engine.linear_mode == mode
            err = (got - want).abs().max().item() / want.abs().max().item()
            # (the file's unquantized output.weight runs as a bf16 GEMM on both: most of int8dot's error)
            assert err < (1e-2 if mode == "int8dot-cpu" else 2e-2), (arch, qtype, err)


def test_folders_people_have_load_and_broken_ones_are_refused_in_one_line(tmp_path, tokenizer_files):
    """A helper's sweep of Hugging Face folders (2026-12-07): what real checkpoints carry loads (SmolLM2's own
    config fields, Unsloth's, Gemma 3's cache_implementation, a stale or adapter safetensors beside the weights,
    Mistral's consolidated copy); a config whose sizes the tensors do not have (memory corruption before), tokens
    past the embedding table (an IndexError), a missing shard or no tokenizer files are one-line refusals."""
    import shutil

    from kvcli.model.loader import ModelLoadError, load_weights
    from kvcli.options import ConfigError

    folder, _ = make_checkpoint(tmp_path, tokenizer_files, "llama")
    cfg = json.loads((folder / "config.json").read_text())

    def variant(name: str, **changes) -> str:
        d = tmp_path / name
        shutil.copytree(folder, d)
        (d / "config.json").write_text(json.dumps({**cfg, **changes}))
        return str(d)

    inert = variant("inert", is_llama_config=True, rope_interleaved=False, unsloth_version="2025.1",
                    unsloth_fixed=True, _attn_implementation_autoset=True, cache_implementation="hybrid",
                    model_max_length=512, gradient_checkpointing=False)
    from safetensors.torch import save_file

    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)},  # a LoRA adapter: not applied
              str(tmp_path / "inert" / "adapter_model.safetensors"))
    save_file({"layers.0.attention.wq.weight": torch.zeros(64, 64)},  # Mistral's own names for the same weights
              str(tmp_path / "inert" / "consolidated.safetensors"))
    loaded = load_weights(inert, quant="none")
    assert set(loaded.weights) == set(load_weights(str(folder), quant="none").weights)  # the extra files not read
    with pytest.raises(ModelLoadError, match="rope_interleaved = true"):
        load_weights(variant("interleaved", rope_interleaved=True))
    for name, change, needle in (("hidden", dict(hidden_size=128), r"has shape \[49152, 64\] where config.json's "
                                 r"sizes make it \[49152, 128\]"),
                                 ("kv", dict(num_key_value_heads=4), r"k_proj.weight has shape \[32, 64\]"),
                                 ("ffn", dict(intermediate_size=256), r"has shape"),
                                 ("layers", dict(num_hidden_layers=1), "hold layer 1 .* num_hidden_layers is 1")):
        with pytest.raises(ModelLoadError, match=needle):
            load_weights(variant(name, **change))
    notok = variant("notok")
    for f in tokenizer_files.iterdir():
        (tmp_path / "notok" / f.name).unlink()
    with pytest.raises(ModelLoadError, match="no tokenizer files"):
        load_weights(notok)
    # tie_word_embeddings with the file's own lm_head: transformers (5.x) computes with the file's, so does kvcli
    tied = variant("tied", tie_word_embeddings=True)
    ids = list(range(5, 40))
    want = logits_through_engine(LLM(str(folder), quant="none", kv_budget="4MiB").engine, ids, 64)
    got = logits_through_engine(LLM(tied, quant="none", kv_budget="4MiB").engine, ids, 64)
    assert torch.equal(got, want)
    llm = LLM(variant("smallvocab", vocab_size=49152), quant="none", kv_budget="4MiB")
    with pytest.raises(ConfigError, match="token id 49152 .* outside the model's 49,152-token vocabulary"):
        llm.engine.add_request([1, 2, 49152], SamplingParams(max_tokens=1))

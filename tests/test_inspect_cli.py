"""`kvcli inspect`: the bundled model's metadata, a K-quant file loaded, and bad input."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cli_helpers import one_line_error
from kvcli.cli import app
from kvcli.commands.plan_cmd import USABLE

runner = CliRunner()


def inspect_json(*args: str) -> dict:
    r = runner.invoke(app, ["inspect", *args, "--json"])
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def test_inspect_bundled_metadata_without_loading():
    rep = inspect_json("--no-load", "--context", "4096")
    assert (rep["architecture"], rep["layers"], rep["heads"], rep["kv_heads"], rep["head_dim"]) == ("llama", 30, 9, 3, 64)
    assert rep["context_length"] == 8192 and rep["resident"] is None
    types = {g["type"]: (g["count"], g["bytes"]) for g in rep["tensors"]}
    assert types["Q4_1"][0] == 210 and types["Q8_0"][0] == 1 and types["F32"][0] == 61
    # Q4_1: 20 B per 32 weights; 30 layers x 3,538,944 linear weights
    assert types["Q4_1"][1] == 30 * 3_538_944 * 20 // 32
    fits = {f["kv_dtype"]: f for f in rep["fits"]}
    assert fits["fp16"]["bytes_per_token"] == 2 * 30 * 3 * 64 * 2  # K and V, 30 layers, 3 KV heads
    assert fits["int8"]["bytes_per_token"] == 2 * 30 * 3 * (64 + 4)  # codes + one fp32 scale per head
    assert fits["fp8"]["bytes_per_token"] == fits["int8"]["bytes_per_token"]  # e4m3 codes, same scales
    budget = rep["kv_budget"]
    assert 0 < budget < rep["memory_available"]
    # what is left for KV: 90% of the memory less the file's tensors and the two rotary tables (8,192 x 64 fp32)
    assert budget == int(rep["memory_available"] * USABLE) - rep["file_tensor_bytes"] - 2 * 8192 * 64 * 4
    for f in fits.values():  # plan's arithmetic: whole 16-token blocks, 4,096 contiguous, ~1,024 paged
        assert f["tokens_fit"] == budget // f["bytes_per_token"]
        assert f["requests_contiguous"] == budget // (f["bytes_per_token"] * 4096)
        assert f["requests_paged"] == budget // (f["bytes_per_token"] * 1024)


def test_inspect_text_names_what_matters():
    r = runner.invoke(app, ["inspect", "--no-load"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.stderr
    out = " ".join(r.stdout.replace("│", " ").split())
    assert "9 heads · 3 KV heads · head dim 64" in out and "context length 8,192 tokens" in out
    assert "tensors Q4_1 210 · 63.3 MiB" in out and "not loaded (--no-load)" in out
    assert "int8 12,240" in out


def test_inspect_loads_a_kquant_file(tiny_kquant):
    rep = inspect_json(str(tiny_kquant))
    types = {g["type"]: g["count"] for g in rep["tensors"]}
    assert types == {"F16": 1, "F32": 5, "Q4_K": 5, "Q6_K": 2, "Q5_K": 2, "Q5_0": 2, "Q5_1": 2, "Q8_0": 1}
    from kquant_model import cpu_path

    # Layer 0 is Q4_K with Q6_K v/down, layer 1 all 5/8-bit (kquant_model.LAYER_TYPES).
    if cpu_path("Q4_K") == "int8dot-cpu":  # kvcli's kernel for every type of the file
        assert rep["linear_paths"] == "int8dot-cpu"
        assert rep["projection_paths"] == {name: {"int8dot-cpu": 2} for name in (
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}
        line = "q_proj k_proj v_proj o_proj gate_proj up_proj down_proj: int8dot-cpu x2"
    else:  # torch's kernels: Q4_K; Q5/Q6/Q8 as two nibbles per code
        assert rep["linear_paths"] == "int4-cpu+int4x2-cpu"
        assert rep["projection_paths"] == {
            "q_proj": {"int4-cpu": 1, "int4x2-cpu": 1}, "k_proj": {"int4-cpu": 1, "int4x2-cpu": 1},
            "v_proj": {"int4x2-cpu": 2}, "o_proj": {"int4-cpu": 1, "int4x2-cpu": 1},
            "gate_proj": {"int4-cpu": 1, "int4x2-cpu": 1}, "up_proj": {"int4-cpu": 1, "int4x2-cpu": 1},
            "down_proj": {"int4x2-cpu": 2}}
        line = "q_proj k_proj o_proj gate_proj up_proj: int4-cpu x1, int4x2-cpu x1 · v_proj down_proj: int4x2-cpu x2"
    r = runner.invoke(app, ["inspect", str(tiny_kquant)], env={"COLUMNS": "250"})
    out = " ".join(r.stdout.replace("│", " ").split())
    assert f"by projection {line}" in out, out
    assert rep["resident"]["embedding"] == 49152 * 256 * 2  # F16 stays half precision
    from kquant_model import HIDDEN, LAYER_TYPES, LAYERS, kernel_bytes, tensor_shapes

    linears = sum(kernel_bytes(types[name], n, k) for types in LAYER_TYPES for name, (n, k) in tensor_shapes().items())
    assert rep["resident"]["layers"] == linears + LAYERS * 2 * HIDDEN * 4  # + fp32 norms


@pytest.mark.parametrize("arg,needle", [("/nonexistent/model.gguf", "model not found"),
                                        ("dummy:nope", "unknown dummy preset")])
def test_inspect_bad_model_is_one_line(arg, needle):
    one_line_error(runner.invoke(app, ["inspect", arg]), needle)


def test_inspect_damaged_gguf_is_one_line(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 20)
    one_line_error(runner.invoke(app, ["inspect", str(bad)]), "broken.gguf")
    one_line_error(runner.invoke(app, ["inspect", "--context", "0"]), "--context")


def test_inspect_checkpoint_folder_counts_safetensors_dtypes(tmp_path):
    import torch
    from safetensors.torch import save_file

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 100, "max_position_embeddings": 256}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({"a": torch.zeros(10, 64, dtype=torch.bfloat16), "b": torch.zeros(64, 64, dtype=torch.bfloat16),
               "c": torch.zeros(64)}, str(tmp_path / "model.safetensors"))
    rep = inspect_json(str(tmp_path), "--no-load")
    assert (rep["layers"], rep["kv_heads"], rep["head_dim"], rep["context_length"]) == (2, 2, 16, 256)
    assert {g["type"]: (g["count"], g["bytes"]) for g in rep["tensors"]} == {"BF16": (2, (640 + 4096) * 2),
                                                                            "F32": (1, 256)}


def test_inspect_shows_the_sliding_window_and_keeps_the_kv_fit(tmp_path):
    import torch
    from safetensors.torch import save_file

    cfg = {"model_type": "mistral", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 8192}
    fits = {}
    for window in (None, 4096):
        d = tmp_path / str(window)
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**cfg, "sliding_window": window}))
        save_file({"c": torch.zeros(64)}, str(d / "model.safetensors"))
        rep = inspect_json(str(d), "--no-load")
        assert rep["sliding_window"] == window
        fits[window] = rep["fits"]
        r = runner.invoke(app, ["inspect", str(d), "--no-load"], env={"COLUMNS": "200"})
        assert r.exit_code == 0, r.stderr
        shown = " ".join(r.stdout.replace("│", " ").split())
        assert ("sliding window 4,096 (blocks before it given back)" in shown) == bool(window)
        if window:
            # Every layer slides: the paged layout holds at most ceil((W - 1 + 512) / 16) + 1 = 289 blocks of the
            # 8,192-token request (a 512-token step budget), 2 layers x 2 KV heads x 16 dims x K,V x fp16 a token.
            assert rep["window_released"] and rep["kv_request_every"] == 8192 * 256
            assert rep["kv_request_held"] == 289 * 16 * 256
            p = runner.invoke(app, ["plan", "--model", str(d), "--context", "8192", "--memory", "1GiB"],
                              env={"COLUMNS": "200"})
            assert p.exit_code == 0, p.stderr
            assert "4,624 tokens at most" in " ".join(p.stdout.replace("│", " ").split()), p.stdout
    # A token's K/V is the same size with a window: the fit per token does not change.
    assert [f["bytes_per_token"] for f in fits[None]] == [f["bytes_per_token"] for f in fits[4096]]


def test_inspect_sizes_its_pool_in_the_kv_dtype_the_engine_picks():
    """The KV format inspect reports is the one an engine built with the
    same flags stores: fp16 on CPU for the bundled Q4_1 where kvcli's C attention kernel builds."""
    from kvcli.attention.torch_backend import native_attention
    from kvcli.engine.llm_engine import LLMEngine
    from kvcli.model.loader import load_weights
    from kvcli.options import EngineOptions

    rep = inspect_json("--device", "cpu", "--context", "4096")
    engine = LLMEngine(load_weights(None), EngineOptions(device="cpu", kv_budget="16MiB"))
    assert rep["kv_dtype"] == engine.kv_dtype.name == ("fp16" if native_attention() is not None else "fp32")
    pool = 2 * 16 * engine.config.kv_bytes_per_token(engine.kv_dtype)  # what inspect hands its engine
    assert LLMEngine(load_weights(None), EngineOptions(device="cpu", kv_budget=str(pool))).num_blocks >= 1
    r = runner.invoke(app, ["inspect", "--device", "cpu"], env={"COLUMNS": "200"})
    assert f"{rep['kv_dtype']} * " in " ".join(r.stdout.replace("│", " ").split())
    assert inspect_json("--no-load")["kv_dtype"] is None  # it depends on the loaded linears


@pytest.mark.slow
def test_resident_is_what_the_process_grows_by(tmp_path):
    """A 118 MiB Q4_0 model (random weights, kvcli/bench/shapes.py), inspected in its own process as a user
    would: the resident figure is the file's tensor bytes (Q4_0 at 18 B per 32, the tied Q8_0 table once), and
    RSS grows by that plus what is not weights (tokenizer, kernels, tables: ~36 MiB for the bundled model),
    not by a second copy of the weights that the allocator kept from the build (before malloc_trim)."""
    import subprocess
    import sys

    from kvcli.bench.shapes import Shape, write_shape

    path = write_shape(tmp_path / "mid.gguf", Shape(1024, 4096, 8, 16, 4, tied=True), "Q4_0")
    out = subprocess.run([sys.executable, "-m", "kvcli.cli", "inspect", str(path), "--json"], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    rep = json.loads(out.stdout)
    resident = sum(rep["resident"].values())
    norms = sum(g["bytes"] for g in rep["tensors"] if g["type"] == "F32")
    assert rep["resident"]["embedding"] == 0, rep["resident"]
    assert rep["file_tensor_bytes"] - norms <= resident <= rep["file_tensor_bytes"], (resident, rep["tensors"])
    # two rotary tables (cos, signed sin) of fp32 for every position, not three
    assert rep["tables"] == 2 * rep["context_length"] * rep["head_dim"] * 4, rep["tables"]
    assert rep["kv_budget"] == max(0, int(rep["memory_available"] * USABLE) - resident - rep["tables"])
    growth = rep["measured_growth"]
    assert 0.95 * (resident + rep["tables"]) <= growth <= resident + rep["tables"] + (64 << 20), (growth, resident)

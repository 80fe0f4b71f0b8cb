"""`kvcli profile` and `kvcli plan` through the CLI: simulated traces, reports, and one-line errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cli_helpers import one_line_error

from kvcli.cli import app
from kvcli.workloads import WorkloadError, from_jsonl, synthetic

runner = CliRunner()
SIM = ["profile", "--model", "dummy:llama-2-7b", "--simulate", "--no-live"]


def test_simulated_compare_contiguous_report(tmp_path):
    js, png = tmp_path / "r.json", tmp_path / "kv.png"
    r = runner.invoke(app, [*SIM, "--kv-budget", "4GiB", "--num-requests", "200", "--compare", "contiguous",
                            "--json", str(js), "--plot", str(png)])
    assert r.exit_code == 0, r.stderr
    assert "token states" in r.stdout and "contiguous (max-len)" in r.stdout
    report = json.loads(js.read_text())
    paged, contig = report["runs"]
    assert paged["layout"] == "paged" and contig["layout"] == "contiguous"
    assert paged["completed"] == contig["completed"] == 200
    assert paged["token_share_of_allocated"] >= 0.98 > 0.40 >= contig["kv_share_of_in_use"]["token_bytes"]
    assert paged["peak_running"] >= 4 * contig["peak_running"]
    tl = paged["timeline"]
    assert len(tl) == paged["steps"] and {"token_bytes", "internal_bytes", "running"} <= set(tl[0])
    # the table prints what the JSON holds
    assert f"{paged['kv_share_of_in_use']['token_bytes']:.1%}" in r.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_jsonl_workload_and_reserve_request(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": "x" * (20 + i), "max_tokens": 10 + i}) for i in range(12)) + "\n")
    runs = {}
    for reserve in ("request", "max-len"):
        # 4 GiB holds four 2,048-token max-len reservations (1 GiB each, fp16 llama-2-7b) but all
        # twelve prompt + max_tokens ones (~40 tokens each).
        r = runner.invoke(app, [*SIM, "--workload", str(f), "--kv-layout", "contiguous", "--reserve", reserve,
                                "--kv-budget", "4GiB", "--json", str(tmp_path / f"{reserve}.json")])
        assert r.exit_code == 0, r.stderr
        runs[reserve] = json.loads((tmp_path / f"{reserve}.json").read_text())["runs"][0]
    for run in runs.values():
        assert run["completed"] == 12 and run["output_tokens"] == sum(10 + i for i in range(12))
    assert runs["request"]["peak_running"] == 12 > runs["max-len"]["peak_running"]


@pytest.mark.parametrize("args,needle", [
    (["--workload", "shakespeare"], "unknown workload 'shakespeare'"),
    (["--request-rate", "fast"], "--request-rate"),
    (["--request-rate", "-2"], "--request-rate"),
    (["--plot", "/nonexistent-dir/kv.png"], "does not exist"),
    (["--json", "/nonexistent-dir/r.json"], "does not exist"),
    (["--kv-budget", "1MB"], "holds no KV block"),
    (["--compare", "hf"], "cannot be simulated"),
    (["--block-size", "12"], "--block-size"),
])
def test_profile_errors(args, needle):
    one_line_error(runner.invoke(app, [*SIM, *args]), needle)


def test_malformed_jsonl_reports_the_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "ok", "max_tokens": 4}\n\n{"prompt": "no end"\n')
    one_line_error(runner.invoke(app, [*SIM, "--workload", str(f)]), "bad.jsonl:3: not valid JSON")
    f.write_text('{"prompt": "ok", "max_tokens": -1}\n')
    with pytest.raises(WorkloadError, match=":1: \"max_tokens\" must be a positive integer"):
        from_jsonl(f)


def test_synthetic_traces_follow_published_means():
    for name, (p, o) in {"sharegpt": (161, 338), "alpaca": (19, 58)}.items():
        t = synthetic(name, 4000, 4096, seed=1)
        assert abs(t.mean_prompt / p - 1) < 0.1 and abs(t.mean_output / o - 1) < 0.1, name
    t = synthetic("sharegpt", 50, 2048, rate=5.0, seed=2)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(t.requests, t.requests[1:])]
    assert all(g >= 0 for g in gaps) and 0.05 < sum(gaps) / len(gaps) < 0.5  # Poisson, mean 0.2 s


def plan_text(*args: str) -> str:
    r = runner.invoke(app, ["plan", "--model", "dummy:llama-2-7b", "--context", "4096", "--memory", "24GiB", *args],
                      env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.stderr
    return " ".join(r.stdout.replace("│", " ").split())


def test_plan_numbers():
    out = plan_text("--batch", "16")
    assert "KV per token 512.0 KiB" in out  # fp16: 2 x 32 x 32 x 128 x 2 B
    assert "KV per request 2.0 GiB" in out  # per 4,096-token request
    assert "rotary tables 4.0 MiB" in out and "minus weights and tables" in out  # 2 x 4,096 x 128 fp32
    # (24 GiB x 0.9 - 4.0 GiB of weights) / 2 GiB per contiguous request = 8; paged at 1,024 tokens = 35
    assert "requests, contiguous 8 " in out and "requests, paged 35 " in out
    assert "--batch 16 contiguous does not fit (8 max)" in out and "--batch 16 paged fits" in out
    one_line_error(runner.invoke(app, ["plan", "--model", "dummy:nope"]), "unknown dummy preset")


def test_plan_json_holds_the_tables_numbers_and_its_exit_status():
    args = ["plan", "--model", "dummy:llama-2-7b", "--context", "4096", "--memory", "24GiB", "--json"]
    r = runner.invoke(app, [*args, "--batch", "16"])
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)  # nothing but the report on stdout
    assert d["kv_bytes_per_token"] == 512 * 1024 and d["kv_bytes_per_request"] == 2 * 2**30
    assert d["rotary_table_bytes"] == 4 * 2**20 and d["mean_tokens"] == 1024 and d["mean_tokens_assumed"]
    assert (d["fit"]["requests_contiguous"], d["fit"]["requests_paged"]) == (8, 35)  # as test_plan_numbers
    assert d["batch_fits"] == {"contiguous": False, "paged": True} and d["exit_status"] == 0
    assert [f["kv_dtype"] for f in d["per_kv_dtype"]] == ["fp32", "fp16", "bf16", "int8", "fp8"]
    r = runner.invoke(app, [*args, "--batch", "64"])
    assert r.exit_code == 2 and json.loads(r.stdout)["batch_fits"] == {"contiguous": False, "paged": False}
    r = runner.invoke(app, [*args[:-2], "1GiB", "--json"])  # the weights alone exceed it
    assert r.exit_code == 1 and json.loads(r.stdout)["fit"] is None
    r = runner.invoke(app, ["plan", "--model", "dummy:llama-2-7b", "--json"])  # --context: the model's, 4,096
    assert r.exit_code == 0 and json.loads(r.stdout)["context"] == 4096 and "exceeds" not in r.stderr


def test_plan_states_its_paged_assumption():
    out = plan_text()
    assert "each holds ~1,024 tokens on average (assumed: context / 4; set --mean-tokens)" in out
    out = plan_text("--mean-tokens", "512")
    assert "requests, paged 70 each holds ~512 tokens on average (--mean-tokens)" in out
    assert "assumed" not in out


def test_plan_prints_every_kv_dtype_side_by_side():
    r = runner.invoke(app, ["plan", "--model", "dummy:llama-3-8b", "--memory", "24GiB", "--kv-dtype", "int8"],
                      env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.stderr
    out = " ".join(r.stdout.split())
    # 2 x 32 layers x 8 KV heads x (128 B codes + 4 B scale) = 67,584 B; fp16: 131,072 B
    assert "│ int8 * │ 67,584 │ 0.52x │ 15,887 │" in out
    assert "│ fp16 │ 131,072 │ 1.00x │ 8,192 │" in out
    assert "│ fp32 │ 262,144 │ 2.00x │ 4,096 │" in out
    assert "│ fp8 │ 67,584 │ 0.52x │ 15,887 │" in out  # e4m3 codes + the same fp32 scales as int8
    one_line_error(runner.invoke(app, ["plan", "--kv-dtype", "int5"]), "--kv-dtype must be one of")


def test_simulated_profile_compares_kv_dtypes_on_one_trace(tmp_path):
    path = tmp_path / "r.json"
    r = runner.invoke(app, ["profile", "--simulate", "-N", "24", "--kv-dtype", "fp16,int8", "--kv-budget", "48MiB",
                            "--no-live", "--json", str(path)], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.stderr
    out = " ".join(r.stdout.split())
    assert "paged fp16" in out and "paged int8" in out and "fp16, 23,040 │ int8, 12,240" in out
    runs = json.loads(path.read_text())["runs"]
    assert [(x["kv_dtype"], x["kv_bytes_per_token"]) for x in runs] == [("fp16", 23040), ("int8", 12240)]
    # Same budget, fewer bytes per token: int8 holds more requests at once.
    assert runs[1]["peak_running"] > runs[0]["peak_running"]
    one_line_error(runner.invoke(app, ["profile", "--simulate", "--kv-dtype", "fp16,fp4"]), "--kv-dtype must be one of")


def test_simulated_profile_compares_fp16_int8_fp8(tmp_path):
    path = tmp_path / "r.json"
    r = runner.invoke(app, ["profile", "--simulate", "-N", "24", "--kv-dtype", "fp16,int8,fp8", "--kv-budget", "48MiB",
                            "--no-live", "--json", str(path)], env={"COLUMNS": "240"})
    assert r.exit_code == 0, r.stderr
    out = " ".join(r.stdout.split())
    assert "paged fp16" in out and "paged int8" in out and "paged fp8" in out
    assert "fp16, 23,040 │ int8, 12,240 │ fp8, 12,240" in out  # fp8: e4m3 codes + the same fp32 scales as int8
    runs = json.loads(path.read_text())["runs"]
    assert [(x["kv_dtype"], x["kv_bytes_per_token"]) for x in runs] == [("fp16", 23040), ("int8", 12240), ("fp8", 12240)]


def profile_tiny_model(tmp_path, *args: str):
    """`kvcli profile` on a real (tiny, random-weight) 2-layer SmolLM2-shaped engine, 3 requests: the
    CliRunner result and the JSON report's runs."""
    from kvcli.config import PRESETS
    tiny = tmp_path / "tiny.json"
    tiny.write_text(json.dumps(dict(PRESETS["smollm2-135m"], num_hidden_layers=2, vocab_size=259)))
    path = tmp_path / "r.json"
    r = runner.invoke(app, ["profile", "--model", f"dummy:{tiny}", "--no-live", "-N", "3", "--max-model-len", "128",
                            *args, "--json", str(path)], env={"COLUMNS": "240"})
    assert r.exit_code == 0, r.stderr or r.stdout
    return r, json.loads(path.read_text())["runs"]


def test_real_profile_runs_fp16_int8_fp8_on_one_trace(tmp_path):
    """A real (tiny, random-weight) engine per KV dtype on the same trace: each run completes, and the
    report names its dtype with its bytes per token (2 layers x 3 KV heads x head_dim 64)."""
    r, runs = profile_tiny_model(tmp_path, "--kv-dtype", "fp16,int8,fp8")
    out = " ".join(r.stdout.split())
    assert "fp16, 1,536 │ int8, 816 │ fp8, 816" in out, out
    assert [(x["kv_dtype"], x["kv_bytes_per_token"]) for x in runs] == [("fp16", 1536), ("int8", 816), ("fp8", 816)]
    assert all(x["completed"] == 3 for x in runs)


def test_real_compare_contiguous_runs_both_layouts_in_one_kv_dtype(tmp_path):
    """paged vs contiguous is the same workload in the same budget and KV format: the second engine
    (sharing the first one's model, whose weights it took) must pick the KV dtype the first one did
    (a bug once gave the paged side fp16 and the contiguous side fp32)."""
    _, runs = profile_tiny_model(tmp_path, "--compare", "contiguous")
    assert len(runs) == 2 and runs[0]["kv_dtype"] == runs[1]["kv_dtype"], runs
    assert runs[0]["kv_bytes_per_token"] == runs[1]["kv_bytes_per_token"]

"""Bad input to every command: each flag with a value out of range, of the wrong type, or impossible
on this machine gets one `kvcli: error:` line on stderr and a non-zero exit, never a traceback or a
usage box. Output that cannot be written (full disk, a folder that vanished, stdout full or closed)
gets the same one-line error, and what was already written stays."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli_helpers import one_line_error

from kvcli.cli import app
from kvcli.config import PRESETS

runner = CliRunner()
KVCLI = [sys.executable, "-c", "from kvcli.cli import main; main()"]
DUMMY = ["--model", "TINY"]  # a 2-layer SmolLM2 with random weights: loads in a moment
SIM = ["profile", "--model", "dummy:llama-2-7b", "--simulate", "--no-live", "-N", "4"]


@pytest.fixture()
def paths(tmp_path: Path) -> dict[str, str]:
    ok = tmp_path / "ok.txt"
    ok.write_text("Once upon a time")
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_text('{"prompt": "ok", "max_tokens": 4}\n{"prompt": 5, "max_tokens": 4}\n')
    neg_jsonl = tmp_path / "neg.jsonl"
    neg_jsonl.write_text('{"prompt": "ok", "max_tokens": -3}\n')
    empty_jsonl = tmp_path / "empty.jsonl"
    empty_jsonl.write_text("")
    latin_jsonl = tmp_path / "latin.jsonl"
    latin_jsonl.write_bytes('{"prompt": "caf\xe9", "max_tokens": 2}\n'.encode("latin-1"))
    nocfg = tmp_path / "ckpt"
    nocfg.mkdir()
    fake = tmp_path / "notes.gguf"
    fake.write_text("these are notes, not a model\n")
    tiny = tmp_path / "tiny.json"
    tiny.write_text(json.dumps(dict(PRESETS["smollm2-135m"], num_hidden_layers=2, vocab_size=259)))
    badcfg = tmp_path / "badcfg"
    badcfg.mkdir()
    (badcfg / "config.json").write_text("{not json")
    folders = {}  # config.json files of the wrong shape: one line naming what is wrong, never a traceback
    good = dict(PRESETS["smollm2-135m"], num_hidden_layers=2)
    for key, text in {"LISTCFG": "[1, 2]", "NUMTYPE": json.dumps({"model_type": 5}),
                      "NOHEADS": json.dumps({k: v for k, v in good.items() if k != "num_attention_heads"}),
                      "ZEROHEADS": json.dumps(dict(good, num_attention_heads=0)),
                      "NEGLAYERS": json.dumps(dict(good, num_hidden_layers=-2)),
                      "GQA": json.dumps(dict(good, num_key_value_heads=4)),
                      "NULLTHETA": json.dumps(dict(good, rope_theta=None))}.items():
        folders[key] = tmp_path / key.lower()
        folders[key].mkdir()
        (folders[key] / "config.json").write_text(text)
    gencfg = tmp_path / "gencfg"
    gencfg.mkdir()
    (gencfg / "config.json").write_text(json.dumps(good))
    (gencfg / "generation_config.json").write_text("[2]")
    folders["GENCFG"] = gencfg
    (tmp_path / "link.txt").symlink_to(ok)
    folders["LINK"] = tmp_path / "link.txt"
    folders["JSONL"] = tmp_path / "w.jsonl"
    folders["JSONL"].write_text('{"prompt": "ok", "max_tokens": 4}\n')
    folders["OUTA"] = tmp_path / "a.png"
    folders["BLANK"] = tmp_path / "blank.txt"
    folders["BLANK"].write_text("  \n\t\n")
    folders["BADPLOT"] = tmp_path / "kv.xyz"
    huge = tmp_path / "huge.json"
    huge.write_text(json.dumps(dict(PRESETS["smollm2-135m"], num_hidden_layers=2, vocab_size=259,
                                    max_position_embeddings=2**40)))
    folders["HUGECTX"] = f"dummy:{huge}"
    return {**{k: str(v) for k, v in folders.items()}, "OK": str(ok), "BADJSONL": str(bad_jsonl),
            "NEGJSONL": str(neg_jsonl), "NOCFG": str(nocfg), "FAKEGGUF": str(fake), "BADCFG": str(badcfg),
            "DIR": str(tmp_path), "EMPTYJSONL": str(empty_jsonl), "LATINJSONL": str(latin_jsonl),
            "TINY": f"dummy:{tiny}"}


# (command line with placeholders, text the one error line must contain)
CASES = [
    # continue: sampling flags
    (["continue", "OK", "-n", "0"], "--max-tokens"),
    (["continue", "OK", "-n", "-3"], "--max-tokens"),
    (["continue", "OK", "-n", "many"], "--max-tokens"),
    (["continue", "OK", "--temperature", "-1"], "--temperature"),
    (["continue", "OK", "--temperature", "hot"], "--temperature"),
    (["continue", "OK", "--temperature", "nan"], "--temperature"),
    (["continue", "OK", "--top-p", "0"], "--top-p"),
    (["continue", "OK", "--top-p", "2"], "--top-p"),
    (["continue", "OK", "--top-k", "-1"], "--top-k"),
    (["continue", "OK", "--top-k", "1.5"], "--top-k"),
    (["continue", "OK", "--seed", "x"], "--seed"),
    (["continue", "OK", "--seed", "-1"], "--seed"),
    (["continue", "OK", "--seed", str(2**64)], "--seed"),
    (["continue", "OK", "--truncate", "tail"], "--truncate"),
    # continue: engine flags
    (["continue", "OK", "--block-size", "0"], "--block-size"),
    (["continue", "OK", "--block-size", "7"], "--block-size"),
    (["continue", "OK", "--block-size", "abc"], "--block-size"),
    (["continue", "OK", "--max-model-len", "0"], "--max-model-len"),
    (["continue", "OK", "--max-model-len", "-5"], "--max-model-len"),
    (["continue", "OK", "--max-batch-tokens", "0"], "--max-batch-tokens"),
    (["continue", "OK", "--kv-budget", "0"], "--kv-budget"),
    (["continue", "OK", "--kv-budget", "-1GiB"], "--kv-budget"),
    (["continue", "OK", "--kv-budget", "lots"], "--kv-budget"),
    (["continue", "OK", "--kv-budget", "10TiB", *DUMMY], "--kv-budget"),
    (["continue", "OK", "--device", "tpu"], "--device"),
    (["continue", "OK", "--device", "cuda", *DUMMY], "--device"),
    (["continue", "OK", "--device", "cuda:7", *DUMMY], "--device"),
    (["continue", "OK", "--attention-backend", "flash"], "--attention-backend"),
    (["continue", "OK", "--quant", "fp3"], "--quant"),
    (["continue", "OK", "--model", "missing.gguf"], "model not found"),
    (["continue", "OK", "--model", "NOCFG"], "no config.json"),
    (["continue", "OK", "--model", "BADCFG"], "config.json"),
    (["continue", "OK", "--model", "FAKEGGUF"], "notes.gguf"),
    (["continue", "OK", "--model", "OK"], "expected a .gguf file"),
    (["continue", "OK", "--model", "dummy:gpt-17"], "unknown dummy preset"),
    (["continue", "OK", "-o", "DIR"], "is a directory"),
    (["continue", "OK", "-o", "/nonexistent-dir/out.txt"], "does not exist"),
    (["continue", "OK", "--bogus-flag"], "--bogus-flag"),
    (["continue"], "Missing argument"),
    (["nosuchcommand"], "nosuchcommand"),
    # chat (errors come before the REPL reads anything)
    (["chat", "-n", "0"], "--max-tokens"),
    (["chat", "--temperature", "-1"], "--temperature"),
    (["chat", "--top-p", "0"], "--top-p"),
    (["chat", "--top-p", "2"], "--top-p"),
    (["chat", "--top-k", "-1"], "--top-k"),
    (["chat", "--seed", "-1"], "--seed"),
    (["chat", "--block-size", "7"], "--block-size"),
    (["chat", "--max-model-len", "0"], "--max-model-len"),
    (["chat", "--kv-budget", "10TiB", *DUMMY], "--kv-budget"),
    (["chat", "--device", "tpu"], "--device"),
    (["chat", "--device", "cuda", *DUMMY], "--device"),
    (["chat", "--model", "missing.gguf"], "model not found"),
    (["chat", "--model", "FAKEGGUF"], "notes.gguf"),
    # profile
    (["profile", "--model", "dummy:llama-2-7b", "--simulate", "-N", "0"], "--num-requests"),
    ([*SIM, "--num-requests", "-1"], "--num-requests"),
    ([*SIM, "--request-rate", "0"], "--request-rate"),
    ([*SIM, "--request-rate", "abc"], "--request-rate"),
    ([*SIM, "--request-rate", "nan"], "--request-rate"),
    ([*SIM, "--request-rate", "-inf"], "--request-rate"),
    ([*SIM, "--workload", "EMPTYJSONL"], "no requests"),
    ([*SIM, "--workload", "LATINJSONL"], "not valid UTF-8"),
    ([*SIM, "--kv-budget", "nan"], "--kv-budget"),
    ([*SIM, "--kv-budget", "inf"], "--kv-budget"),
    ([*SIM, "--workload", "nonexistent.jsonl"], "nonexistent.jsonl"),
    ([*SIM, "--workload", "BADJSONL"], "bad.jsonl:2"),
    ([*SIM, "--workload", "NEGJSONL"], "neg.jsonl:1"),
    ([*SIM, "--kv-dtype", "int3"], "--kv-dtype"),
    ([*SIM, "--block-size", "0"], "--block-size"),
    ([*SIM, "--block-size", "7"], "--block-size"),
    ([*SIM, "--block-size", "abc"], "--block-size"),
    ([*SIM, "--max-model-len", "0"], "--max-model-len"),
    ([*SIM, "--max-model-len", "-5"], "--max-model-len"),
    ([*SIM, "--max-batch-tokens", "0"], "--max-batch-tokens"),
    ([*SIM, "--max-num-seqs", "0"], "--max-num-seqs"),
    ([*SIM, "--kv-layout", "ring"], "--kv-layout"),
    ([*SIM, "--reserve", "all"], "--reserve"),
    ([*SIM, "--preempt", "drop"], "--preempt"),
    ([*SIM, "--compare", "vllm"], "--compare"),
    ([*SIM, "--seed", "abc"], "--seed"),
    ([*SIM, "--kv-budget", "0.0"], "--kv-budget"),
    ([*SIM, "--json", "DIR"], "is a directory"),
    ([*SIM, "--plot", "/nonexistent-dir/kv.png"], "does not exist"),
    (["profile", *DUMMY, "--no-live", "-N", "2", "--device", "tpu"], "--device"),
    (["profile", *DUMMY, "--no-live", "-N", "2", "--device", "cuda"], "--device"),
    (["profile", *DUMMY, "--no-live", "-N", "2", "--kv-budget", "10TiB"], "--kv-budget"),
    (["profile", "--model", "missing.gguf", "--simulate", "-N", "2"], "model not found"),
    (["profile", "--model", "NOCFG", "--simulate", "-N", "2"], "config.json"),
    (["profile", "--model", "FAKEGGUF", "--simulate", "-N", "2"], "notes.gguf"),
    # plan
    (["plan", "--context", "0"], "--context"),
    (["plan", "--context", "-1"], "--context"),
    (["plan", "--context", "long"], "--context"),
    (["plan", "--batch", "0"], "--batch"),
    (["plan", "--mean-tokens", "0"], "--mean-tokens"),
    (["plan", "--memory", "abc"], "--memory"),
    (["plan", "--memory", "0"], "--memory"),
    (["plan", "--memory", "-4GiB"], "--memory"),
    (["plan", "--memory", "nan"], "--memory"),
    (["plan", "--kv-dtype", "int3"], "--kv-dtype"),
    (["plan", "--block-size", "7"], "--block-size"),
    (["plan", "--block-size", "abc"], "--block-size"),
    (["plan", "--model", "missing.gguf"], "model not found"),
    (["plan", "--model", "NOCFG"], "no config.json"),
    (["plan", "--model", "BADCFG"], "config.json"),
    (["plan", "--model", "FAKEGGUF"], "notes.gguf"),
    (["plan", "--model", "LISTCFG"], "expected a JSON object, found list"),
    (["plan", "--model", "NUMTYPE"], "model_type = 5"),
    (["plan", "--model", "NOHEADS"], "missing field num_attention_heads"),
    (["plan", "--model", "ZEROHEADS"], "num_attention_heads = 0"),
    (["plan", "--model", "NEGLAYERS"], "num_layers = -2"),
    (["plan", "--model", "GQA"], "9 attention heads do not split into 4"),
    (["plan", "--model", "NULLTHETA"], "wrong type"),
    (["plan", "--model", "GENCFG"], "generation_config.json: expected a JSON object"),
    (["continue", "OK", "--model", "LISTCFG"], "expected a JSON object, found list"),
    (["continue", "OK", "--model", "ZEROHEADS"], "num_attention_heads = 0"),
    (["continue", "OK", "--model", "GENCFG"], "generation_config.json"),
    # an output that is an input, or one path for two outputs: refused before anything is written
    (["continue", "OK", "-o", "OK"], "is the input file"),
    (["continue", "OK", "-o", "LINK"], "is the input file"),
    ([*SIM, "--workload", "JSONL", "--json", "JSONL"], "is the input file"),
    ([*SIM, "--json", "OUTA", "--plot", "OUTA"], "given for two outputs"),
    # the default --kv-window auto on a context too short to stream past (was "at most -23")
    (["continue", "OK", "-n", "100", "--max-model-len", "8"], "8-token context is too short to stream a text past it"),
    (["continue", "OK", "-n", "100", "--max-model-len", "116"], "so 117 tokens; raise --max-model-len, or pass "
                                                                  "--kv-window none"),
    (["plan", "--model", "dummy:nope"], "unknown dummy preset"),
    # an output longer than the whole context names -n, not the text (a 6-token text was told it was too long)
    (["continue", "OK", "-n", "100000"], "--max-tokens 100,000 is past the 8,192-token context"),
    # ... and at the model's own context, raising --max-model-len cannot help: a window that slides can
    (["continue", "OK", "-n", "9000"], "(e.g. --kv-window 2048) that slides on while it generates"),
    # a plain number above 1 with a fraction is neither a share of memory nor whole bytes
    (["continue", "OK", "--kv-budget", "1.5"], "a fraction of free memory must be in (0, 1]"),
    (["plan", "--memory", "0"], "a size must be positive"),
    (["plan", "--mean-tokens", "100", "--context", "10"], "--mean-tokens 100 is more than --context 10"),
    (["continue", "BLANK"], "only whitespace"),
    # a declared context whose rotary tables cannot be held: refused before they are built, naming the flag
    (["continue", "OK", "--model", "HUGECTX"], "pass --max-model-len"),
    ([*SIM, "-N", "100001"], "at most 100,000"),
    # a plot format matplotlib does not write: refused before the run, no file created
    ([*SIM, "--plot", "BADPLOT"], "a plot cannot be written as .xyz"),
    (["watch", "http://[::1", "--once", "--no-live", "--plot", "BADPLOT"], "a plot cannot be written as .xyz"),
    (["watch", "http://[::1", "--once", "--no-live"], "not a URL that can be watched"),
    (["watch", "http://host:abc", "--once", "--no-live"], "Invalid port"),
    # an origin no browser sends would leave CORS off without a word
    (["serve", "--port", "0", "--allowed-origins", ":::"], "an origin is scheme://host[:port]"),
    (["serve", "--port", "0", "--allowed-origins", "https://ok.example,https://app.example/"],
     "--allowed-origins https://app.example/:"),
]


@pytest.mark.parametrize("argv,needle", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_input_is_one_line(paths, argv, needle):
    # A model-loading command gets the tiny model first, so that a missing check fails fast
    # instead of running the bundled one; a --model in the case itself comes later and wins.
    if argv[0] in ("continue", "chat"):
        at = 2 if argv[0] == "continue" and len(argv) > 1 else 1
        argv = argv[:at] + [*DUMMY, "--no-live"] * (argv[0] == "continue") + DUMMY * (argv[0] == "chat") + argv[at:]
    argv = [paths.get(a, a) for a in argv]
    one_line_error(runner.invoke(app, argv, input=""), needle)
    assert not Path(paths["BADPLOT"]).exists()  # a refused plot leaves no file behind


# Output that cannot be written --------------------------------------------------------------------

def _tiny(tmp_path: Path) -> str:
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(dict(PRESETS["smollm2-135m"], num_hidden_layers=2, vocab_size=259)))
    return f"dummy:{cfg}"


def _continue_argv(tmp_path: Path, *extra: str) -> list[str]:
    src = tmp_path / "in.txt"
    src.write_text("The lighthouse keeper wrote in his log every night.")
    return ["continue", str(src), "--model", _tiny(tmp_path), "--no-live", "-n", "40", *extra]


def _assert_error_last(stderr: str, needle: str) -> None:
    """Informational lines may come first; the error is one line, the last, with no traceback and no
    second complaint from the interpreter flushing stdout at exit."""
    lines = stderr.strip().splitlines()
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
    assert [ln for ln in lines if "error" in ln.lower()] == lines[-1:], stderr
    assert lines[-1].startswith("kvcli: error:") and needle in lines[-1], stderr


def _run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*KVCLI, *argv], capture_output="stdout" not in kw, text=True, timeout=120,
                          stderr=subprocess.PIPE if "stdout" in kw else None, **kw)


def test_output_file_on_a_full_disk_keeps_stdout(tmp_path):
    p = _run(_continue_argv(tmp_path, "-o", "/dev/full"))
    assert p.returncode == 1
    _assert_error_last(p.stderr, "/dev/full: cannot write (No space left on device)")
    assert p.stdout.strip()  # the continuation streamed before the file was written stays


def test_output_folder_removed_while_the_model_loads(tmp_path, monkeypatch):
    import kvcli.commands.continue_cmd as cc

    gone = tmp_path / "gone"
    gone.mkdir()
    real = cc.build_engine

    def load_then_remove(*a, **kw):
        engine = real(*a, **kw)
        shutil.rmtree(gone)  # the -o folder vanishes after the start-up check
        return engine

    monkeypatch.setattr(cc, "build_engine", load_then_remove)
    r = runner.invoke(app, _continue_argv(tmp_path, "-o", str(gone / "out.txt")))
    assert r.exit_code == 1
    _assert_error_last(r.stderr, f"{gone / 'out.txt'}: cannot write (No such file or directory)")
    assert r.stdout.strip()


def test_stdout_full(tmp_path):
    with open("/dev/full", "w") as full:
        p = _run(_continue_argv(tmp_path), stdout=full)
    assert p.returncode == 1
    _assert_error_last(p.stderr, "cannot write to standard output (No space left on device)")


def test_stdout_closed_by_the_reader(tmp_path):
    cmd = " ".join(map(shlex_quote, [*KVCLI, *_continue_argv(tmp_path, "-n", "300", "--max-model-len", "512")]))
    p = subprocess.run(["bash", "-c", f"{cmd} | head -c 10; exit ${{PIPESTATUS[0]}}"], capture_output=True,
                       text=True, timeout=120)
    assert len(p.stdout) == 10
    assert p.returncode == 1
    _assert_error_last(p.stderr, "cannot write to standard output (Broken pipe)")


def test_stdout_closed_at_start(tmp_path):
    cmd = " ".join(map(shlex_quote, [*KVCLI, "plan", "--model", "dummy:llama-2-7b"]))
    p = subprocess.run(["bash", "-c", f"{cmd} >&-"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1
    _assert_error_last(p.stderr, "standard output is closed")


def test_plan_to_a_full_stdout():
    with open("/dev/full", "w") as full:
        p = _run(["plan", "--model", "dummy:llama-2-7b"], stdout=full)
    assert p.returncode == 1
    _assert_error_last(p.stderr, "cannot write to standard output (No space left on device)")


def test_profile_json_on_a_full_disk_keeps_the_table():
    r = runner.invoke(app, [*SIM, "--json", "/dev/full"])
    assert r.exit_code == 1
    _assert_error_last(r.stderr, "/dev/full: cannot write (No space left on device)")
    assert "token states" in r.stdout


def test_profile_plot_on_a_full_disk():
    r = runner.invoke(app, [*SIM, "--plot", "/dev/full"])
    assert r.exit_code == 1
    _assert_error_last(r.stderr, "/dev/full: cannot write (No space left on device)")
    assert "token states" in r.stdout


def shlex_quote(s: str) -> str:
    import shlex

    return shlex.quote(s)


def test_an_output_naming_the_input_leaves_the_input_as_it_was(paths):
    """continue -o INPUT once replaced the user's text with the continuation."""
    text = Path(paths["OK"]).read_bytes()
    for out in (paths["OK"], paths["LINK"]):
        one_line_error(runner.invoke(app, ["continue", paths["OK"], *DUMMY, "--no-live", "-n", "2", "-o", out],
                                     input=""), "is the input file")
        assert Path(paths["OK"]).read_bytes() == text


@pytest.mark.parametrize("qc,needle", [({"quant_method": "fp8", "activation_scheme": "dynamic"}, "'fp8'"),
                                       ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits=8")])
def test_plan_and_simulation_refuse_a_folder_quantized_as_kvcli_cannot_read(tmp_path, qc, needle):
    """plan and profile --simulate read only config.json, yet a plan of weights kvcli would refuse to load (an
    FP8 or 8-bit GPTQ folder) is no plan: the same one line as loading it."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 512, "quantization_config": qc}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    one_line_error(runner.invoke(app, ["plan", "-m", str(tmp_path)]), needle)
    one_line_error(runner.invoke(app, ["profile", "--model", str(tmp_path), "--simulate", "--no-live", "-N", "2"]),
                   needle)
    del cfg["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert runner.invoke(app, ["plan", "-m", str(tmp_path)]).exit_code == 0


def test_a_multimodal_folder_is_refused_as_such(tmp_path):
    """An image-text checkpoint kvcli does not run the text model of (Llama 3.2 Vision's cross-attention layers; the
    text models of image-text Gemma 3, LLaVA and Mistral 3 folders it runs: tests/test_architectures.py) says what
    it is, not that its text_config field is unread."""
    cfg = {"architectures": ["MllamaForConditionalGeneration"], "model_type": "mllama",
           "text_config": {"model_type": "mllama_text_model", "hidden_size": 64, "num_hidden_layers": 2,
                           "cross_attention_layers": [1]},
           "vision_config": {"model_type": "mllama_vision_model"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for args in (["plan", "-m", str(tmp_path)], ["inspect", str(tmp_path)]):
        err = one_line_error(runner.invoke(app, args), "MllamaForConditionalGeneration is a multimodal checkpoint")
        assert "text-only" in err and "text_config =" not in err
    # an image-text family kvcli reads, with a key it does not know beside text_config: refused, naming it
    cfg = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "image_grid_pinpoints": [[336, 672]],
           "text_config": {"model_type": "llama"}, "vision_config": {"model_type": "clip_vision_model"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    one_line_error(runner.invoke(app, ["plan", "-m", str(tmp_path)]), "field image_grid_pinpoints of an image-text llava")


def test_a_qwen_vl_folder_with_rotary_kvcli_cannot_match_is_refused(tmp_path):
    """Qwen2-VL / Qwen2.5-VL: M-RoPE is Qwen2's rotary on text only when its sections cover the rotary's frequencies
    and nothing else scales it (tests/test_architectures.py runs the ones that do); otherwise one line, naming it."""
    text = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1e6)
    cases = [({"type": "mrope", "mrope_section": [2, 3, 4]}, "mrope_section [2, 3, 4] does not split the rotary's 8"),
             ({"type": "mrope", "mrope_section": [2, 3, 3], "factor": 2.0}, "M-RoPE with other scaling"),
             ({"type": "yarn", "factor": 2.0}, "rope_scaling of type 'yarn' in an image-text qwen2_5_vl")]
    for scaling, needle in cases:
        cfg = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", **text,
               "rope_scaling": scaling, "vision_config": {"depth": 1}, "image_token_id": 151655}
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        one_line_error(runner.invoke(app, ["plan", "-m", str(tmp_path)]), needle)
    cfg = {"model_type": "qwen2_vl", "text_config": {**text, "model_type": "qwen2_vl_text"}, "vision_config": {},
           "spatial_merge_size": 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    one_line_error(runner.invoke(app, ["plan", "-m", str(tmp_path)]),
                   "field spatial_merge_size of an image-text qwen2_vl")
    cfg["spatial_merge_size"] = None
    del cfg["spatial_merge_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = runner.invoke(app, ["plan", "-m", str(tmp_path)])
    assert r.exit_code == 0, r.output

"""The engine flags, declared once (kvcli/commands/engine_flags.py) and shared by the commands: every command
still takes exactly the flags it took before, with the same defaults, and they reach EngineOptions."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from kvcli.cli import app

runner = CliRunner()

# Every flag of every command, as `kvcli CMD --help` listed them before the engine flags were shared
# (captured from the per-command declarations). A flag missing here or there fails the test.
FLAGS_BEFORE = {
    "chat": {'--attention-backend', '--block-size', '--dequantize', '--device', '--kv-budget', '--kv-dtype', '--live',
             '--max-model-len', '--max-tokens', '--model', '--ngram-max', '--ngram-min', '--no-live',
             '--no-prefix-cache', '--num-speculative-tokens', '--prefix-cache', '--quant', '--seed', '--speculate',
             '--system', '--temperature', '--top-k', '--top-p', '--truncate', '-m', '-n', '-s', '-t'},
    "continue": {'--attention-backend', '--block-size', '--dequantize', '--device', '--json', '--kv-budget',
                 '--kv-dtype', '--live', '--max-batch-tokens', '--max-model-len', '--max-tokens', '--model',
                 '--ngram-max', '--ngram-min', '--no-live', '--no-prefix-cache', '--num-speculative-tokens',
                 '--output', '--prefix-cache', '--quant', '--seed', '--speculate', '--temperature', '--top-k',
                 '--top-p', '--truncate', '-m', '-n', '-o', '-t'},
    "inspect": {'--block-size', '--context', '--device', '--json', '--load', '--no-load', '-c'},
    "perplexity": {'--attention-backend', '--block-size', '--dequantize', '--device', '--json', '--kv-budget',
                   '--kv-dtype', '--max-batch-tokens', '--max-model-len', '--model', '--quant', '--stride',
                   '--window', '-m'},
    "plan": {'--batch', '--block-size', '--context', '--json', '--kv-dtype', '--mean-tokens', '--memory', '--model',
             '-b', '-c', '-m'},
    "profile": {'--attention-backend', '--block-size', '--compare', '--concurrency', '--dequantize', '--device',
                '--endpoint', '--json', '--kv-budget', '--kv-dtype', '--kv-layout', '--live', '--max-batch-tokens',
                '--max-model-len', '--max-num-seqs', '--model', '--ngram-max', '--ngram-min', '--no-live',
                '--no-prefix-cache', '--num-requests', '--num-speculative-tokens', '--plot', '--preempt',
                '--prefix-cache', '--quant', '--request-rate', '--reserve', '--seed', '--simulate', '--speculate',
                '--workload', '-N', '-m', '-w'},
    "serve": {'--attention-backend', '--block-size', '--dequantize', '--device', '--host', '--kv-budget', '--kv-dtype',
              '--kv-layout', '--log-level', '--max-batch-tokens', '--max-model-len', '--max-num-seqs', '--model',
              '--ngram-max', '--ngram-min', '--no-prefix-cache', '--num-speculative-tokens', '--port', '--preempt',
              '--prefix-cache', '--quant', '--served-model-name', '--speculate', '-m', '-p',
              # kvcli serve's own request limits and guards (issue #31)
              '--api-key', '--metrics-need-key', '--allowed-hosts', '--allowed-origins', '--max-request-bytes',
              '--max-tokens-default', '--max-waiting-requests', '--request-timeout'},
    "watch": {'--duration', '--interval', '--live', '--no-live', '--once', '--plot', '--record', '-i'},
}

# The bounded KV cache's flags (issue #27), added since (profile and serve: item 5).
for _cmd in ("chat", "continue", "perplexity", "profile", "serve"):
    FLAGS_BEFORE[_cmd] |= {'--kv-window', '--sink-tokens'}

# Penalties on continue and chat, and the client's API key on watch and profile (issue #31), added since.
for _cmd in ("chat", "continue"):
    FLAGS_BEFORE[_cmd] |= {'--repetition-penalty', '--presence-penalty', '--frequency-penalty'}
for _cmd in ("profile", "watch"):
    FLAGS_BEFORE[_cmd] |= {'--api-key'}

# Decode steps from CUDA graphs (issue #28), on the commands that generate, added since.
for _cmd in ("chat", "continue", "profile", "serve"):
    FLAGS_BEFORE[_cmd] |= {'--cuda-graphs', '--no-cuda-graphs'}

# The draft length of speculation (issue #30, item 4), with the other speculation flags, added since.
for _cmd in ("chat", "continue", "profile", "serve"):
    FLAGS_BEFORE[_cmd] |= {'--draft-length'}

# CPU threads, fixed or tuned by timing decode steps (runner/threads.py), on the commands that build an engine.
for _cmd in ("chat", "continue", "perplexity", "profile", "serve"):
    FLAGS_BEFORE[_cmd] |= {'--threads'}

# The engine flags' defaults per command, as declared before (enums by value).
DEFAULTS_BEFORE = {
    "chat": {'--model': None, '--block-size': 16, '--kv-budget': None, '--quant': 'auto', '--dequantize': False,
             '--device': None, '--attention-backend': 'auto', '--max-model-len': None, '--kv-dtype': None,
             '--prefix-cache': True, '--speculate': 'none', '--num-speculative-tokens': 5, '--ngram-min': 2,
             '--ngram-max': 4},
    "continue": {'--model': None, '--block-size': 16, '--kv-budget': None, '--quant': 'auto', '--dequantize': False,
                 '--device': None, '--attention-backend': 'auto', '--max-model-len': None, '--max-batch-tokens': 512,
                 '--kv-dtype': None, '--prefix-cache': True, '--speculate': 'none', '--num-speculative-tokens': 5,
                 '--ngram-min': 2, '--ngram-max': 4},
    "inspect": {'--block-size': 16, '--device': None},
    "perplexity": {'--model': None, '--block-size': 16, '--kv-budget': None, '--kv-dtype': None, '--quant': 'auto',
                   '--dequantize': False, '--device': None, '--attention-backend': 'auto', '--max-model-len': None,
                   '--max-batch-tokens': 512},
    "plan": {'--kv-dtype': 'fp16', '--block-size': 16, '--model': None},
    "profile": {'--kv-layout': 'paged', '--reserve': 'max-len', '--preempt': 'recompute', '--model': None,
                '--block-size': 16, '--kv-budget': None, '--kv-dtype': None, '--max-model-len': 2048,
                '--max-batch-tokens': 512, '--max-num-seqs': 256, '--quant': 'auto', '--dequantize': False,
                '--device': None, '--attention-backend': 'auto', '--prefix-cache': True, '--speculate': 'none',
                '--num-speculative-tokens': 5, '--ngram-min': 2, '--ngram-max': 4},
    "serve": {'--model': None, '--block-size': 16, '--kv-budget': None, '--kv-dtype': None, '--max-model-len': None,
              '--max-batch-tokens': 512, '--max-num-seqs': 64, '--kv-layout': 'paged', '--preempt': 'recompute',
              '--quant': 'auto', '--dequantize': False, '--device': None, '--attention-backend': 'auto',
              '--prefix-cache': True, '--speculate': 'none', '--num-speculative-tokens': 5, '--ngram-min': 2,
              '--ngram-max': 4},
}


def _commands() -> dict:
    return typer.main.get_command(app).commands


def _options(command) -> list:
    return [p for p in command.params if isinstance(p, typer.core.TyperOption)]


def test_every_command_keeps_its_flags():
    commands = _commands()
    assert set(commands) == set(FLAGS_BEFORE)
    for name, command in commands.items():
        flags = {o for p in _options(command) for o in (*p.opts, *p.secondary_opts)}
        assert flags == FLAGS_BEFORE[name], (name, FLAGS_BEFORE[name] - flags, flags - FLAGS_BEFORE[name])


def test_every_command_keeps_its_engine_flag_defaults():
    for name, command in _commands().items():
        defaults = {p.opts[0]: getattr(p.default, "value", p.default) for p in _options(command)
                    if p.opts[0] in DEFAULTS_BEFORE.get(name, {})}
        assert defaults == DEFAULTS_BEFORE.get(name, {}), name


@pytest.mark.parametrize("name", sorted(FLAGS_BEFORE))
def test_help_lists_the_flags(name):
    r = runner.invoke(app, [name, "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0
    for flag in FLAGS_BEFORE[name]:
        if flag.startswith("--") and not flag.startswith("--no-"):
            assert flag in r.stdout, (name, flag)


def test_a_flag_is_declared_once_with_one_help_text():
    """A shared flag reads the same in every command but where a command gives it its own default or text."""
    from kvcli.commands.engine_flags import FLAGS

    variants = {("profile", "kv_layout"), ("profile", "max_model_len"), ("plan", "kv_dtype"), ("profile", "kv_dtype"),
                ("continue", "kv_window")}
    for name, command in _commands().items():
        for p in _options(command):
            if p.name in FLAGS and (name, p.name) not in variants:
                assert p.help == FLAGS[p.name].option.help, (name, p.name)


def test_flags_reach_engine_options(monkeypatch):
    import kvcli.commands.serve_cmd as serve_cmd

    seen = {}
    monkeypatch.setattr(serve_cmd, "run_serve", lambda args, fail: seen.setdefault("args", args) and 0)
    r = runner.invoke(app, ["serve", "-m", "dummy:llama-2-7b", "--quant", "int4", "--block-size", "32",
                            "--kv-budget", "1GiB", "--kv-dtype", "int8", "--max-model-len", "1024",
                            "--max-batch-tokens", "256", "--max-num-seqs", "8", "--kv-layout", "contiguous",
                            "--preempt", "swap", "--dequantize", "--device", "cpu", "--attention-backend", "torch",
                            "--no-prefix-cache", "--speculate", "ngram", "--num-speculative-tokens", "3",
                            "--ngram-min", "1", "--ngram-max", "3"])
    assert r.exit_code == 0, r.stderr
    a = seen["args"]
    assert (a.model, a.quant) == ("dummy:llama-2-7b", "int4")
    o = a.options
    assert (o.block_size, o.kv_budget, o.kv_dtype, o.max_model_len, o.max_num_batched_tokens, o.max_num_seqs) == (
        32, "1GiB", "int8", 1024, 256, 8)
    assert (o.kv_layout, o.preempt, o.dequantize, o.device, o.attention_backend, o.prefix_caching) == (
        "contiguous", "swap", True, "cpu", "torch", False)
    assert (o.speculate, o.num_speculative_tokens, o.ngram_min, o.ngram_max) == ("ngram", 3, 1, 3)


def test_defaults_build_the_same_options_as_before(monkeypatch):
    """No flags: each command's EngineOptions are the dataclass defaults but for its own (profile's
    max_model_len and max_num_seqs, perplexity's prefix caching off)."""
    import kvcli.commands.perplexity_cmd as perplexity_cmd
    import kvcli.commands.profile_cmd as profile_cmd
    from kvcli.options import EngineOptions

    seen = {}
    monkeypatch.setattr(profile_cmd, "run_profile", lambda args, fail: seen.setdefault("profile", args) and 0)
    monkeypatch.setattr(perplexity_cmd, "run_perplexity", lambda args, fail: seen.setdefault("ppl", args) and 0)
    assert runner.invoke(app, ["profile"]).exit_code == 0
    assert runner.invoke(app, ["perplexity", "x.txt"]).exit_code == 0
    assert seen["profile"].options == EngineOptions(max_model_len=2048, max_num_seqs=256)
    assert seen["profile"].quant == "auto" and seen["profile"].model is None
    assert seen["ppl"].options == EngineOptions(prefix_caching=False)


def test_model_help_names_every_dummy_preset():
    """--model's help lists the dummy: presets by hand (engine_flags does not import torch, which kvcli.config
    does); a preset added without it once went unlisted (gemma-3-4b, gemma-3-270m, gemma-2-2b)."""
    from kvcli.commands.engine_flags import FLAGS
    from kvcli.config import PRESETS

    text = FLAGS["model"].option.help
    assert all(name in text for name in PRESETS), [name for name in PRESETS if name not in text]

"""KV groups (kvcache/kv_groups.py, kvcache/hybrid.py): a model whose layers attend over different spans (Gemma 2 / 3)
keeps one block table per group of layers in the paged layout, so its windowed layers hold only their window's
blocks. The grouping, the layout under the real scheduler (simulated runner: no model), and the real engine on
a tiny Gemma 3 against the same engine with one table for every layer and against transformers."""

from __future__ import annotations

import random

import pytest
import torch

from engine_steps import teacher_forced
from kvcli.config import ModelConfig, SamplingParams
from kvcli.engine.llm_engine import LLMEngine
from kvcli.kvcache.block_manager import PagedKVManager, sliding_window_blocks
from kvcli.kvcache.hybrid import HybridKVManager
from kvcli.kvcache.kv_groups import kv_groups_for, kv_groups_of
from kvcli.options import EngineOptions

GEMMA3 = dict(model_type="gemma3_text", vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=64,
              max_position_embeddings=4096)


def _gemma3(**over) -> ModelConfig:
    return ModelConfig.from_hf_dict({**GEMMA3, **over}, name="sim-gemma3")


# the grouping --------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("windows", "slots", "kinds"), [
    ([0] * 4, 4, [0]),  # full attention everywhere: one table
    ([8] * 4, 4, [8]),  # Mistral: every layer slides, one table (the plain layout releases the window)
    ([8, 0] * 3, 3, [0, 8]),  # Gemma 2: alternating, two tables of 3 layers each
    ([0 if (i + 1) % 6 == 0 else 512 for i in range(26)], 4, [0] + [512] * 6),  # Gemma 3 1B: 4 global, 22 local
    ([0 if (i + 1) % 6 == 0 else 1024 for i in range(62)], 10, [0] + [1024] * 6),  # Gemma 3 27B
])
def test_groups_partition_the_layers_into_equal_pages(windows, slots, kinds):
    g = kv_groups_for(windows)
    assert g.slots == slots and [grp.window for grp in g.groups] == kinds
    layers = sorted(i for grp in g.groups for i in grp.layers)
    assert layers == list(range(len(windows)))  # every layer once
    for grp in g.groups:
        assert 0 < len(grp.layers) <= slots and all(windows[i] == grp.window for i in grp.layers)
    # Layers of one group use distinct slots (their K/V live side by side in the group's pages).
    for grp in g.groups:
        assert len({g.slot_of[i] for i in grp.layers}) == len(grp.layers)
    assert [g.group_of[i] for i in range(len(windows))] == \
        [next(k for k, grp in enumerate(g.groups) if i in grp.layers) for i in range(len(windows))]


def test_pages_held_at_32k_for_a_gemma3_shape():
    """The goal's arithmetic: 5 windowed layers per global one, window 1,024, at 32k tokens in 16-token blocks
    and 512-token steps: the global group every block, each windowed group ceil((1023 + 512) / 16) + 1 = 97."""
    g = kv_groups_of(_gemma3(sliding_window=1024, num_hidden_layers=6, max_position_embeddings=32768))
    assert g.slots == 1 and len(g.groups) == 6
    held = g.pages_held(32768, 16, 512)
    assert held == 2048 + 5 * sliding_window_blocks(1024, 512, 16) == 2048 + 5 * 97
    assert held / (6 * 2048) < 0.3


# the layout under the scheduler --------------------------------------------------------------------------

@pytest.mark.parametrize("preempt", ["recompute", "swap"])
def test_simulated_gemma3_requests_hold_their_windows_per_group(preempt):
    """The real scheduler (speculation, n = 2 forks, shared prefixes, preemption) over a pool too small for the
    requests kept whole: every group's invariants hold after every step, each windowed group's table holds at
    most its window's bound, every request finishes, and every block comes back."""
    cfg = _gemma3()
    per_block = cfg.kv_bytes_per_token("fp16") * 16  # every layer: six pages of one layer
    opts = EngineOptions(block_size=16, kv_budget=str(30 * per_block), max_model_len=4096, kv_dtype="fp16",
                         max_num_batched_tokens=48, speculate="ngram", preempt=preempt, swap_space=str(200 * per_block))
    e = LLMEngine(None, opts, config=cfg)
    assert isinstance(e.kv, HybridKVManager) and e.kv_groups.slots == 1
    assert e.kv.num_blocks == 30 * 6 - 1  # pages of one layer: six per block of the plain layout
    bound = sliding_window_blocks(64, 48, 16)
    shared = list(range(7, 7 + 40))
    rng = random.Random(0)
    reqs = [e.add_request(shared + [rng.randrange(1, 999) for _ in range(300 + 60 * i)],
                          SamplingParams(max_tokens=120, ignore_eos=True, n=1 + (i == 0))) for i in range(4)]
    while e.has_unfinished():
        e.step()
        e.kv.check_invariants()
        for r in e.scheduler.running:
            for m in e.kv.managers[1:]:
                assert len(m.held_blocks(r.req_id)) <= bound
    done = [e.requests[r.req_id] for r in reqs] + [e.requests[f"{reqs[0].req_id}.1"]]
    assert all(len(r.output_token_ids) == 120 and r.finish_reason == "length" for r in done)
    assert e.kv.num_free_blocks == e.kv.num_blocks
    assert e.kv.recycled_blocks > 0
    st = e.kv.stats([], None)
    assert st.used_blocks == 0 and st.prefix_hit_tokens > 0  # the shared prefix was taken, in every group


def test_one_table_keeps_every_block_and_groups_do_not():
    """The same Gemma 3 shape and budget: with KV groups a 2,000-token request fits where one table for every
    layer needs more blocks than the pool has; the plain layout is what --kv-layout contiguous and a bounded
    cache (--kv-window) use."""
    from kvcli.engine.scheduler import KVBudgetTooSmall

    cfg = _gemma3()
    per_block = cfg.kv_bytes_per_token("fp16") * 16
    opts = dict(block_size=16, kv_budget=str(60 * per_block), max_model_len=4096, kv_dtype="fp16")
    one = LLMEngine(None, EngineOptions(**opts, kv_groups=False), config=cfg)
    assert isinstance(one.kv, PagedKVManager) and not one.kv_groups.hybrid
    with pytest.raises(KVBudgetTooSmall):
        one.add_request(list(range(1, 2000)), SamplingParams(max_tokens=8, ignore_eos=True))
    e = LLMEngine(None, EngineOptions(**opts), config=cfg)
    req = e.add_request(list(range(1, 2000)), SamplingParams(max_tokens=8, ignore_eos=True))
    while e.has_unfinished():
        e.step()
    assert len(req.output_token_ids) == 8
    for flags in (dict(kv_layout="contiguous"), dict(kv_window=512)):
        assert not LLMEngine(None, EngineOptions(**opts, **flags), config=cfg).kv_groups.hybrid


def test_block_map_marks_the_groups():
    """The live view's map: windowed groups' full blocks drawn apart, blocks counted per group."""
    from kvcli.view.block_map import WINDOWED, render_block_map, state_counts

    cfg = _gemma3()
    per_block = cfg.kv_bytes_per_token("fp16") * 16
    e = LLMEngine(None, EngineOptions(block_size=16, kv_budget=str(40 * per_block), kv_dtype="fp16",
                                      max_num_batched_tokens=64), config=cfg)
    req = e.add_request(list(range(1, 600)), SamplingParams(max_tokens=4, ignore_eos=True))
    while req.num_computed_tokens < 599:
        e.step()
    snap = e.snapshot(block_map=True)
    bm = snap.blocks
    # The views' bytes: a token's K/V over every layer (a block here is a page of one layer), and the what-if of
    # max-length contiguous preallocation priced per token of every layer in the same pool's bytes.
    assert snap.kv_bytes_per_token == cfg.kv_bytes_per_token("fp16") == 6 * snap.bytes_per_block // 16
    region = e.max_model_len * cfg.kv_bytes_per_token("fp16")
    assert snap.whatif_fits == e.num_blocks * e.bytes_per_block // region
    assert snap.kv.token_bytes == sum(m._token_slots(e.scheduler.stats().running) for m in e.kv.managers) \
        * snap.bytes_per_block // 16
    counts = state_counts(bm)
    assert counts["windowed"] > 0 and counts["full"] == 599 // 16  # the global table: every full block
    windowed_held = sum(len(m.held_blocks(req.req_id)) for m in e.kv.managers[1:])
    assert counts["windowed"] + counts["partial"] - 1 == windowed_held  # + one partial block per windowed table - 5
    from rich.console import Console

    c = Console(width=100, record=True, color_system=None)
    c.print(render_block_map(bm, width=80, height=10))
    text = c.export_text()
    assert WINDOWED in text and f"held per KV group: global {599 // 16 + 1:,} · W 64 (5 tables) {windowed_held:,}" in text


# the real engine -----------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "invariant"])
def test_gemma3_with_groups_holds_its_windows_with_logits_unchanged(gemma3_folder, backend):
    """The tiny Gemma 3 (5 layers of window 8 per global one) over 120 tokens, prefill in chunks of 7 then decode
    steps: with KV groups the windowed tables hold at most ceil((8 - 1 + 7) / 8) + 1 = 3 blocks each, the logits
    equal bit for bit those of one table for every layer (which holds all 15 blocks in every layer), and both stay
    within 1e-4 of transformers."""
    from kvcli.llm import LLM

    path, ref = gemma3_folder
    ids = [(i * 7919) % 40000 + 300 for i in range(120)]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    got = {}
    for groups in (True, False):
        llm = LLM(str(path), quant="none", attention_backend=backend, block_size=8, kv_budget="4MiB",
                  max_num_batched_tokens=7, kv_groups=groups)
        kv = llm.engine.kv
        assert isinstance(kv, HybridKVManager) == groups
        got[groups] = teacher_forced(llm.engine, ids, prefill=60, chunk=7)
        if groups:
            assert all(m.peak_held_blocks <= 3 for m in kv.managers[1:]) and kv.managers[0].peak_held_blocks == 15
            assert kv.peak_held_blocks <= 15 + 5 * 3
        else:
            assert kv.peak_held_blocks == 15
    assert torch.equal(got[True], got[False])
    err = (got[True] - want).abs().max().item() / want.abs().max().item()
    assert err < 1e-4, f"relative logit error {err:.2e}"


@pytest.mark.slow
def test_gemma3_generation_with_groups_equals_one_table(gemma3_folder):
    """Greedy generation through the scheduler (two prompts, one with n = 2, guesses, a shared prefix, a pool
    small enough that one table for every layer preempts with swaps): the same tokens with KV groups as without."""
    from kvcli.llm import LLM

    path, _ = gemma3_folder
    outs = {}
    prefix = [(i * 131) % 30000 + 300 for i in range(40)]
    for groups in (True, False):
        llm = LLM(str(path), quant="none", block_size=8, kv_budget="300KiB", max_num_batched_tokens=16,
                  speculate="ngram", preempt="swap", swap_space="1MiB", kv_groups=groups)
        prompts = [prefix + [(i * 17) % 97 + 500 for i in range(80)], prefix + [(i * 7) % 50 + 900 for i in range(30)]]
        res = llm.generate(prompts, [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, n=2),
                                     SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)])
        outs[groups] = [[list(s.token_ids) for s in (r, *r.samples)] for r in res]
        llm.engine.kv.check_invariants()
        if not groups:
            assert llm.engine.scheduler.num_preemptions > 0
    assert outs[True] == outs[False]


def test_continue_keeps_kv_groups_for_a_text_that_fits():
    """--kv-window auto (continue's and chat's default) builds a bounded cache, whose one table keeps every
    layer's tokens; for a text that fits with its generation, continue rebuilds the KV side without it, so a
    Gemma keeps its per-group tables. Nothing changes once a request exists, nor on a model without groups."""
    from kvcli.config import PRESETS

    e = LLMEngine(None, EngineOptions(kv_window="auto", kv_dtype="fp16"), config=_gemma3())
    assert e.retention is not None and not e.kv_groups.hybrid
    assert e.unbounded_for_kv_groups()
    assert e.retention is None and isinstance(e.kv, HybridKVManager) and e.options.kv_window is None
    assert not e.unbounded_for_kv_groups()  # nothing left to do
    llama = LLMEngine(None, EngineOptions(kv_window="auto"), config=ModelConfig.from_hf_dict(PRESETS["smollm2-135m"]))
    assert not llama.unbounded_for_kv_groups() and llama.retention is not None
    busy = LLMEngine(None, EngineOptions(kv_window="auto", kv_dtype="fp16"), config=_gemma3())
    busy.add_request([5, 6, 7], SamplingParams(max_tokens=2))
    assert not busy.unbounded_for_kv_groups() and busy.retention is not None


@pytest.mark.slow
def test_continue_cli_on_a_gemma3_uses_kv_groups(gemma3_folder, tmp_path):
    """`kvcli continue` on the tiny Gemma 3: a short text runs with per-group tables (--json names them); one
    longer than the context streams through the bounded cache's one table, as before."""
    import json

    from typer.testing import CliRunner

    from kvcli.cli import app

    path, _ = gemma3_folder
    text = tmp_path / "t.txt"
    text.write_text("The keeper climbed the stairs and lit the lamp. " * 4, encoding="utf-8")
    r = CliRunner().invoke(app, ["continue", str(text), "--model", str(path), "--quant", "none", "-n", "8",
                                 "--temperature", "0", "--json", "--no-live"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["kv_groups"].startswith("6 block tables per request") and rep["kv_window"] is None
    assert len(rep["generated_token_ids"]) == 8
    text.write_text("The keeper climbed the stairs and lit the lamp. " * 60, encoding="utf-8")  # > 512 tokens
    r = CliRunner().invoke(app, ["continue", str(text), "--model", str(path), "--quant", "none", "-n", "8",
                                 "--temperature", "0", "--json", "--no-live"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["kv_groups"] is None and rep["kv_window"] is not None and rep["dropped_tokens"] > 0


def test_every_layout_implements_the_kv_layout_protocol():
    """The scheduler talks to any layout through KVLayout: the KV groups' layout answers every member too."""
    from kvcli.kvcache.contiguous import ContiguousArena
    from kvcli.kvcache.interface import KVLayout

    members = {n for n in vars(KVLayout) if not n.startswith("_")} | set(KVLayout.__annotations__)
    layouts = [PagedKVManager(8, 16), ContiguousArena(8, 16, reserve="max-len", max_model_len=64),
               HybridKVManager(8, 16, kv_groups_for([8, 0]))]
    for layout in layouts:
        missing = sorted(n for n in members if not hasattr(layout, n))
        assert not missing, f"{type(layout).__name__} lacks {missing}"
        assert layout.group_tables("nobody")[0] == layout.block_table("nobody") == []
        assert layout.held_blocks("nobody") == []

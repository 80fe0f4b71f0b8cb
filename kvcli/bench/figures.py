"""Every figure README.md and docs/benchmarks.md quote, and the one entry that prints it.

A figure is a function `main(argv) -> int` of a module of this package (or, for the two that are outputs of
an entry-point script, that script), the arguments `make figures` gives it, the environment it runs under
(the AVX2 figures) and the file of docs/results/ that holds its current raw output, named after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcli.bench.harness import AVX2_ENV, NOAMX_ENV


@dataclass(frozen=True)
class Figure:
    name: str
    entry: str  # "module:function" in kvcli.bench, or "script:<command>" (an entry point of scripts/)
    about: str
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    in_make_figures: bool = True  # re-measured by `make figures` (the others: run by hand, see about)

    @property
    def results(self) -> str:
        return f"docs/results/{self.name}.txt"


_PROFILE = ("profile", "--workload", "sharegpt", "--num-requests", "64", "--max-model-len", "2048", "--block-size",
            "16", "--kv-budget", "512MiB", "--compare", "contiguous", "--no-live", "--plot",
            "docs/profile-sharegpt-cpu.png")
_SIMULATE = ("profile", "--model", "dummy:llama-2-13b", "--kv-budget", "12GiB", "--workload", "sharegpt",
             "--num-requests", "1000", "--simulate", "--compare", "contiguous", "--no-live")

FIGURES: dict[str, Figure] = {f.name: f for f in [
    Figure("decode", "batch1:decode", "batch-1 decode tok/s: kvcli INT4, kvcli --dequantize, transformers"),
    Figure("cpu", "batch1:cpu", "batch 1 at 512 and 4k: kvcli vs transformers vs llama.cpp (make bench)",
           ("--repeats", "2")),
    Figure("cpu-avx2", "batch1:cpu", "the cpu figure with torch, kvcli's C kernels and llama.cpp held to AVX2",
           ("--repeats", "2"), AVX2_ENV),
    Figure("load", "load:main", "load time of the bundled model, empty and warm kvcli cache"),
    Figure("build", "build_time:main", "compile time of kvcli's C kernels: each source, a first load's build, "
           "the KV dtype loops built on first need"),
    Figure("continue", "cli:main", "kvcli continue on the 4k-token sample",
           ("continue", "samples/keepers-log.txt", "-n", "40", "--no-live")),
    Figure("throughput", "throughput:main", "64-request trace: kvcli vs transformers (3 ways) vs llama.cpp",
           ("--workload", "alpaca", "--num-requests", "64")),
    Figure("throughput-avx2", "throughput:main", "the throughput figure held to AVX2",
           ("--workload", "alpaca", "--num-requests", "64"), AVX2_ENV),
    Figure("throughput-1b", "throughput:main", "the 64-request trace on the random-weight 1B shape (Q4_0): kvcli vs "
           "llama.cpp with 16 parallel sequences", ("--shape", "1b", "--workload", "alpaca", "--num-requests", "64")),
    Figure("throughput-1b-noamx", "throughput:main", "the throughput-1b figure on AVX-512 without AMX (kvcli's AMX "
           "paths and oneDNN's held off; on a CPU without AMX, the plain run)",
           ("--shape", "1b", "--workload", "alpaca", "--num-requests", "64"), NOAMX_ENV, in_make_figures=False),
    Figure("throughput-1b-avx2", "throughput:main", "the throughput-1b figure held to AVX2 (torch, kvcli's C kernels, "
           "llama.cpp's AVX2 build)", ("--shape", "1b", "--workload", "alpaca", "--num-requests", "64"), AVX2_ENV,
           in_make_figures=False),
    Figure("continue-past-window", "cli:main", "kvcli continue on a text 2.5x the context (the bounded KV cache)",
           ("continue", "samples/lunyu-zh.txt", "-n", "60", "--temperature", "0", "--no-live")),
    Figure("streaming", "streaming:quality", "bounded KV cache quality: recompute vs sinks + window vs no sinks "
           "(StreamingLLM's comparison, kvcli perplexity)"),
    Figure("window-cost", "streaming:cost", "bounded KV cache speed: decode at 4x the context, prefill through "
           "the window"),
    Figure("dashboard-groups", "dashboard:groups", "the live view in tmux on Gemma 3 270M's shape (random weights): "
           "the block map with the windowed layers' own block tables"),
    Figure("kv-groups", "kv_groups:main", "KV groups: a Gemma-3-shaped model's KV held at 32k context with per-group "
           "block tables vs one table, logits compared"),
    Figure("profile", "cli:main", "paged vs contiguous KV on the bundled model (kvcli profile)", _PROFILE),
    Figure("simulate", "cli:main", "paged vs contiguous KV, simulated 13B (kvcli profile --simulate)", _SIMULATE),
    Figure("live", "live:main", "cost of the live dashboard on decode"),
    Figure("dashboard", "dashboard:main", "the live view captured in tmux (120x50) during decode"),
    Figure("dashboard-window", "dashboard:window", "the live view in tmux while a text of 2.5x the context "
           "streams through --kv-window 1024 (blocks recycling), then during decode"),
    Figure("kv-dtype", "kv_dtype:main", "every --kv-dtype: perplexity, bytes, decode at 4k, agreement"),
    Figure("kv-decode", "kv_dtype:decode", "decode at 4k per --kv-dtype, interleaved rounds, thread CPU time"),
    Figure("kv-int4", "kv_int4:main", "what an int4 KV cache would cost in perplexity at 4k (not shipped)"),
    Figure("threads", "threads:main", "--threads auto against fixed counts, idle and with one core kept busy by "
           "another process (the bundled model, batch 1)", in_make_figures=False),
    Figure("attention-order", "attention_order:main", "decode attention alone on the 1B shape's heads at 8k: K/V "
           "from memory vs hot in L2, by the order of the request's blocks (ascending, descending, random)",
           in_make_figures=False),
    Figure("kv-attention", "kv_attention:main", "decode attention alone per KV format at 4k (no model)",
           ("--rounds", "9"), in_make_figures=False),
    Figure("invariant", "invariant:main", "what --attention-backend invariant costs"),
    Figure("spec", "spec:main", "speculative decoding by prompt lookup (~17 min)",
           ("--repeats", "2", "--attention-backend", "invariant")),
    Figure("spec-default", "spec:main", "speculation at batch 1 on the default attention backend (the one-call C "
           "decode takes the verification steps)", ("--repeats", "2", "--skip-batch", "--skip-hf")),
    Figure("spec-long", "spec:main", "spec-default after 3,500-token prompts, where a verified row's attention "
           "makes each guess dearer", ("--repeats", "2", "--skip-batch", "--skip-hf", "--prompt-tokens", "3500",
                                       "--new-tokens", "256"), in_make_figures=False),
    Figure("prefill-chunks", "prefill_chunks:main", "prefill tok/s by --max-batch-tokens (256-2048) on the 1B shape "
           "and the bundled model, and how long one chunk step holds a running batch: the default's measurement"),
    Figure("spec-ceiling", "spec_ceiling:main", "the ceiling of speculation by prompt lookup: tokens per step of "
           "the greedy continuation replayed at k = 1-7 (the speedup at a free verification), checked against the "
           "engine"),
    Figure("spec-sampled", "spec:main", "speculation on sampled continuations (T=0.8)",
           ("--repeats", "2", "--skip-batch", "--skip-hf", "--temperature", "0.8"), in_make_figures=False),
    Figure("folder-quant", "folder_quant:main", "--quant on a dense folder: kvcli int4 vs NF4 vs fp32 vs the GGUF, "
           "perplexity and decode"),
    Figure("architectures", "architectures:main", "qwen3, phi3, gemma3, gemma2 decode against a llama of the same bytes"),
    Figure("kquants", "kquants:main", "K-quant GGUFs against Q4_1: resident bytes, load, decode",
           ("--repeats", "5", "--new-tokens", "64"), in_make_figures=False),
    Figure("kquants-avx2", "kquants:main", "the kquants figure held to AVX2",
           ("--repeats", "5", "--new-tokens", "64"), AVX2_ENV, in_make_figures=False),
    Figure("roofline", "roofline:main", "batch 1 on a random-weight 1B-shape Q4_0 GGUF: kvcli vs llama.cpp at 512 "
           "and 8k, with the measured read bandwidth and matrix peak (~10 min)", in_make_figures=False),
    Figure("roofline-noamx", "roofline:main", "the roofline figure on AVX-512 without AMX (kvcli's AMX paths and "
           "oneDNN's held off; on a CPU without AMX, the plain run) (~10 min)", env=NOAMX_ENV, in_make_figures=False),
    Figure("roofline-avx2", "roofline:main", "the roofline figure held to AVX2 (torch, kvcli's C kernels, llama.cpp's "
           "AVX2 build) (~15 min)", env=AVX2_ENV, in_make_figures=False),
    Figure("verify-step", "verify_step:main", "a step of 1-8 query rows after a cached context against a 1-row "
           "decode step (what speculative verification costs)"),
    Figure("verify-step-1b", "verify_step:main", "the verify-step figure on the random-weight 1B shape (Q4_0), "
           "where a step reads its weights from memory", ("--shape", "1b"), in_make_figures=False),
    Figure("roofline-3b", "roofline:main", "the roofline figure on the 3B shape (Q4_0) at 512 and 4k (~15 min)",
           ("--shape", "3b", "--contexts", "512,4096"), in_make_figures=False),
    Figure("roofline-8b", "roofline:main", "the roofline figure on the 8B shape (Q4_K_M) at 512, one round (~10 min; "
           "8k would take over half an hour of prefill on 2 cores)",
           ("--shape", "8b", "--kind", "Q4_K_M", "--contexts", "512", "--rounds", "1", "--new-tokens", "16"),
           in_make_figures=False),
    Figure("resident", "resident:main", "resident weights vs file bytes and measured RSS growth on 1B/3B/8B "
           "shapes (kvcli inspect)"),
    Figure("hf-quant", "hf_quant:main", "AWQ / GPTQ / compressed-tensors folders against the bundled GGUF",
           in_make_figures=False),
    Figure("serve", "serve:main", "kvcli serve against the in-process engine, and kvcli watch's cost",
           ("--threads", "1", "--rounds", "3"), in_make_figures=False),
    Figure("conformance-margins", "conformance:main", "the GGUF conformance suite's measured errors against "
           "llama.cpp beside the bounds it asserts, per variant file (~1 min)", in_make_figures=False),
    Figure("lm-eval", "lm_eval_check:main", "lm-eval's local-completions on kvcli serve against its hf backend, "
           "per-item log-likelihoods (lm-eval from its own venv)", in_make_figures=False),
    Figure("serve-vs-llama-server", "serve_vs_llama:main", "kvcli serve beside llama.cpp's llama-server",
           ("--threads", "1"), in_make_figures=False),
    Figure("prefill-attention", "prefill_attention:main", "prefill attention: kvcli's C kernel vs torch",
           in_make_figures=False),
    Figure("prefill-attention-avx2", "prefill_attention:main", "the prefill-attention figure held to AVX2",
           env=AVX2_ENV, in_make_figures=False),
    Figure("int8dot-ops", "int8dot:main", "per-linear times: int8dot vs torch int4 vs read-back + GEMM",
           in_make_figures=False),
    Figure("int8dot-ops-avx2", "int8dot:main", "the int8dot-ops figure held to AVX2", env=AVX2_ENV,
           in_make_figures=False),
    Figure("int8-gemm-smollm2-avx2", "int8dot:main", "SmolLM2's linears from 64 rows held to AVX2: kvcli's int8 GEMM "
           "beside the read-back + GEMM and the fused fp32 GEMM (what a prefill chunk's linears cost per route)",
           ("--many-rows",), AVX2_ENV, in_make_figures=False),
    Figure("int8dot-ops-1b", "int8dot:main", "the int8dot-ops figure on the 1B shape's linears, around where the "
           "read-back starts to pay (taken on a Xeon with AMX)", ("--shape", "1b"), in_make_figures=False),
    Figure("int8-gemm-1b", "int8dot:main", "the 1B shape's linears from 32 rows: kvcli's int8 GEMM (one activation "
           "level) beside the bf16 read-back + GEMM and the fused fp32 GEMM", ("--shape", "1b", "--many-rows", "--calls",
                                                                               "5"), in_make_figures=False),
    Figure("int8-gemm-1b-avx2", "int8dot:main", "the int8-gemm-1b figure held to AVX2", ("--shape", "1b", "--many-rows",
                                                                                       "--calls", "5"),
           env=AVX2_ENV, in_make_figures=False),
    Figure("weight-tiers", "weight_tiers:main", "decode per weight tier: kvcli's kernel, torch's int4 (no C compiler), "
           "codes dequantized per call", in_make_figures=False),
    # Before and after the house redesign (issue #26: weight plan, kvcli/native, step types, engine flags, this
    # package): efe4681 is the tree before it. `python -m kvcli.bench ab-decode --save` (an idle machine).
    Figure("ab-decode", "ab:main", "before/after: the decode figure at efe4681 and in this tree, interleaved",
           ("--before", "efe4681", "decode", "--rounds", "3"), in_make_figures=False),
    # Issue #30 on the bundled model: bd0c652 is the tree before the AMX tiles and the weight prefetch.
    Figure("ab-decode-30", "ab:main", "before/after: the decode figure at bd0c652 (before AMX tiles and the weight "
           "prefetch) and in this tree, interleaved", ("--before", "bd0c652", "decode", "--rounds", "3"),
           in_make_figures=False),
    # The AMX bf16 GEMM for prefill chunks (issue #30, item 3): ee03d89 is the tree before it (read-back + torch's GEMM).
    Figure("ab-prefill-30", "ab:main", "before/after: the roofline figure's 512-token prefill and decode at ee03d89 "
           "(before the AMX bf16 GEMM) and in this tree, interleaved",
           ("--before", "ee03d89", "roofline", "--rounds", "3", "--", "--contexts", "512", "--rounds", "1"),
           in_make_figures=False),
    # The AVX-512 decode/prefill attention and the heap policy (issue #30, 2026-12-06): 3d0a14d is the tree before them.
    Figure("ab-decode-attention", "ab:main", "before/after: the bundled model's decode figure at 3d0a14d (before the "
           "AVX-512 attention paths and the heap policy) and in this tree, interleaved",
           ("--before", "3d0a14d", "decode", "--rounds", "3"), in_make_figures=False),
    # Whether the bundled model's batch-1 decode moved since 2026-12-03 (a57316f: the oldest tree that runs beside
    # Hugging Face's `kernels` package in the venv), or only this VM's phase (the cpu figure re-taken 2026-12-06).
    Figure("ab-decode-1203", "ab:main", "before/after: the bundled model's decode figure at a57316f (2026-12-03) and "
           "in this tree, interleaved", ("--before", "a57316f", "decode", "--rounds", "3"), in_make_figures=False),
    # The C kernels' build split for a first load's compile time, and int8 / fp8 caches in the one-call decode loop
    # (2026-12-06 evening): 41cb1fc is the tree before them.
    Figure("ab-decode-build", "ab:main", "before/after: the bundled model's decode figure at 41cb1fc (before the "
           "kernels' build split and quantized caches in the C decode loop) and in this tree, interleaved",
           ("--before", "41cb1fc", "decode", "--rounds", "3"), in_make_figures=False),
    # The AVX2 decode attention's register-resident form (issue #30, 2026-12-06): 6da4b92 is the tree before it.
    Figure("ab-attention-avx2", "ab:main", "before/after: the AVX2 64-request trace on the bundled model (kvcli "
           "only) at 6da4b92 (before the 8-lane register-resident decode attention) and in this tree, interleaved",
           ("--before", "6da4b92", "throughput-avx2", "--rounds", "3", "--", "--compare", "none"),
           in_make_figures=False),
    Figure("ab-throughput", "ab:main", "before/after: the throughput trace at efe4681 and in this tree, interleaved",
           ("--before", "efe4681", "throughput", "--rounds", "3", "--", "--modes", "static,generate_batch"),
           in_make_figures=False),
    # The int8 GEMM for prefill chunks without AMX (issue #30, items 2-3): 54ea48f is the tree before it.
    Figure("ab-prefill-int8", "ab:main", "before/after: the bundled model's batch-1 prefill and decode at 512 and 4k "
           "(kvcli only) at 54ea48f (bf16 read-back for 256+-row chunks) and in this tree (the int8 GEMM), interleaved",
           ("--before", "54ea48f", "cpu", "--rounds", "3", "--", "--engines", "kvcli", "--repeats", "1"),
           in_make_figures=False),
    # The int8 GEMM from 32 rows for Q4_0 / Q4_1 forms (issue #30, the 64-request trace): 6c55b77 is the tree before.
    Figure("ab-int8-rows", "ab:main", "before/after: the bundled model's 64-request trace (kvcli only) at 6c55b77 "
           "(batched decode steps of 32-255 rows in the two-level kernel) and in this tree (the int8 GEMM), interleaved",
           ("--before", "6c55b77", "throughput", "--rounds", "3", "--", "--workload", "alpaca", "--num-requests", "64",
            "--llama-cpp", "none", "--compare", "none"), in_make_figures=False),
    Figure("ab-int8-rows-1b", "ab:main", "the ab-int8-rows comparison on the random-weight 1B shape (Q4_0)",
           ("--before", "6c55b77", "throughput", "--rounds", "2", "--", "--shape", "1b", "--workload", "alpaca",
            "--num-requests", "64", "--llama-cpp", "none", "--compare", "none"), in_make_figures=False),
    # Query groups in the C decode kernel (issue #30, item 4): c5dfea2 is the tree before them.
    Figure("ab-verify-step", "ab:main", "before/after: the verify-step figure at c5dfea2 (a verification's rows read "
           "the KV once each) and in this tree (once per request), interleaved",
           ("--before", "c5dfea2", "verify-step", "--rounds", "3", "--", "--rounds", "5"), in_make_figures=False),
    # A query group's heads in passes of up to 6, not 4 (cpu_attention.c HEADS512): 7beb56e is the tree before.
    Figure("ab-verify-heads6", "ab:main", "before/after: the verify-step figure at 7beb56e (a query group's K / V "
           "rows converted once per 4 heads) and in this tree (once per 6), interleaved",
           ("--before", "7beb56e", "verify-step", "--rounds", "4", "--", "--rounds", "9"), in_make_figures=False),
    # The small-row loop on records (cpu_int8dot.c one_rec) and greedy verification's argmax through NumPy
    # (sampler.argmax_rows): f9b421f is the tree before both.
    Figure("ab-verify-recs", "ab:main", "before/after: the verify-step figure at f9b421f (the small-row loop reading "
           "each row's blocks in place, torch's argmax over a verification's rows) and in this tree (records side "
           "by side, NumPy's argmax), interleaved",
           ("--before", "f9b421f", "verify-step", "--rounds", "6", "--", "--rounds", "9"), in_make_figures=False),
    # The small-row loops' weight codes also asked into L2 16 KiB ahead (cpu_int8dot.c prefetch_far): a1d9535 is
    # the tree before.
    Figure("ab-verify-far", "ab:main", "before/after: the verify-step figure on the 1B shape at a1d9535 (the "
           "small-row loops ask for their weights 16 blocks ahead only) and in this tree (16 KiB ahead into L2 as "
           "well), interleaved",
           ("--before", "a1d9535", "verify-step", "--rounds", "4", "--", "--shape", "1b", "--rounds", "5"),
           in_make_figures=False),
    # The two-level forms' 16-column loop for 2-8 rows (cpu_int8dot.c group_block16): 4ab581e is the tree before.
    Figure("ab-verify-kquant", "ab:main", "before/after: the verify-step figure on the 1B shape in Q4_K_M at 4ab581e "
           "(2-8 rows of the two-level forms on the 8-column loop, 4 rows a pass) and in this tree (16 columns, 8 rows "
           "a pass), interleaved", ("--before", "4ab581e", "verify-step", "--rounds", "3", "--", "--shape", "1b",
                                    "--kind", "Q4_K_M", "--rounds", "5"), in_make_figures=False),
    Figure("ab-verify-far-avx2", "ab:main", "the ab-verify-far comparison held to AVX2 (its 8-column small-row loops)",
           ("--before", "a1d9535", "verify-step", "--rounds", "3", "--", "--shape", "1b", "--rounds", "5"), AVX2_ENV,
           in_make_figures=False),
    Figure("ab-verify-far-bundled", "ab:main", "the ab-verify-far comparison on the bundled model (whose weights stay "
           "in L3)", ("--before", "a1d9535", "verify-step", "--rounds", "3", "--", "--rounds", "5"),
           in_make_figures=False),
    Figure("triton-matrix", "script:bash scripts/triton_matrix.sh", "kernel tests under older Triton releases",
           in_make_figures=False),
    Figure("gpu-check-dry-run", "script:python3 scripts/gpu_check.py --dry-run",
           "the GPU check's plan and time budget, without a GPU", in_make_figures=False),
    # On a lent GPU (docs/kernels.md, "GPU check"): each file is the run's log, the report printed at its end.
    Figure("gpu-check", "script:python3 scripts/gpu_check.py --sections acgdh --section-seconds "
           "a=50,c=60,g=80,d=130,h=95", "the GPU check on an H200: kernels, INT4 sweeps, CUDA graphs, the engine, "
           "transformers (run on the device machine)", in_make_figures=False),
    Figure("gpu-attention", "script:python3 scripts/gpu_check.py", "the first full GPU check on an H200: its decode "
           "attention (b) and KV-dtype (e) tables are current, the rest superseded by gpu-check", in_make_figures=False),
    Figure("gpu-env", "script:bash scripts/gpu_env.sh", "the GPU machine of the gpu-check runs", in_make_figures=False),
    # One activation level for Q4_0 / Q4_1 forms at every row count, the int8 GEMM from 6 rows on AVX-512-VNNI and
    # in the one-call C decode (issue #30, 2026-12-07): a5c4a1e is the tree before it.
    Figure("ab-one-level", "ab:main", "before/after: the bundled model's decode figure at a5c4a1e (two activation "
           "levels below the int8 GEMM's rows) and in this tree (one level, two in outlier blocks), interleaved",
           ("--before", "a5c4a1e", "decode", "--rounds", "3", "--", "--repeats", "2"), in_make_figures=False),
    Figure("ab-one-level-1b", "ab:main", "the ab-one-level comparison on the 1B shape: the roofline figure's 512-token "
           "prefill and decode at a5c4a1e and in this tree, interleaved",
           ("--before", "a5c4a1e", "roofline", "--rounds", "3", "--", "--contexts", "512", "--rounds", "1"),
           in_make_figures=False),
    Figure("ab-one-level-trace", "ab:main", "the ab-one-level comparison on the 1B shape's 64-request trace (kvcli "
           "only)", ("--before", "a5c4a1e", "throughput", "--rounds", "2", "--", "--shape", "1b", "--workload",
                     "alpaca", "--num-requests", "64", "--llama-cpp", "none", "--compare", "none"),
           in_make_figures=False),
    Figure("ab-one-level-bundled-trace", "ab:main", "the ab-one-level comparison on the bundled model's 64-request "
           "trace (kvcli only)", ("--before", "a5c4a1e", "throughput", "--rounds", "3", "--", "--workload", "alpaca",
                                  "--num-requests", "64", "--llama-cpp", "none", "--compare", "none"),
           in_make_figures=False),
    Figure("ab-one-level-avx2", "ab:main", "the ab-one-level comparison held to AVX2 (torch and kvcli's C kernels): "
           "the bundled model's decode, kvcli only",
           ("--before", "a5c4a1e", "decode", "--rounds", "3", "--", "--repeats", "2", "--engines", "kvcli"), AVX2_ENV,
           in_make_figures=False),
    Figure("ab-one-level-verify", "ab:main", "the ab-one-level comparison on the verify-step figure",
           ("--before", "a5c4a1e", "verify-step", "--rounds", "3", "--", "--rounds", "5"), in_make_figures=False),
    # One level on AMX CPUs below the bf16 GEMM, and the 16-column small-row loop up to 8 rows (issue #30, item 4):
    # faadf02 is the tree before both (on AMX: two levels, int8 tiles from 8 rows; elsewhere the 8-column loop).
    Figure("ab-amx-one-level", "ab:main", "before/after: the verify-step figure at faadf02 (on AMX CPUs two "
           "activation levels below 256 rows; 6+ rows in kvq_gemm_i8) and in this tree (one level, the 16-column "
           "small-row loop to 8 rows), interleaved", ("--before", "faadf02", "verify-step", "--rounds", "3", "--",
                                                       "--rounds", "5"), in_make_figures=False),
    Figure("ab-amx-one-level-decode", "ab:main", "the ab-amx-one-level comparison on the bundled model's decode "
           "figure (kvcli only)", ("--before", "faadf02", "decode", "--rounds", "3", "--", "--repeats", "2",
                                   "--engines", "kvcli"), in_make_figures=False),
    Figure("ab-amx-one-level-trace", "ab:main", "the ab-amx-one-level comparison on the 1B shape's 64-request trace "
           "(kvcli only)", ("--before", "faadf02", "throughput", "--rounds", "2", "--", "--shape", "1b", "--workload",
                            "alpaca", "--num-requests", "64", "--llama-cpp", "none", "--compare", "none"),
           in_make_figures=False),
    Figure("ab-amx-one-level-1b", "ab:main", "the ab-amx-one-level comparison on the 1B shape: the roofline figure's "
           "512-token prefill and decode", ("--before", "faadf02", "roofline", "--rounds", "3", "--", "--contexts",
                                            "512", "--rounds", "1"), in_make_figures=False),
    Figure("ab-scratch", "ab:main", "before/after: the bundled model's kvcli decode at 0377745 (kvq_linear and "
           "kva_decode allocating per call, the outlier limit's serial sum) and in this tree, interleaved",
           ("--before", "0377745", "decode", "--rounds", "6", "--", "--engines", "kvcli"), in_make_figures=False),
    Figure("ab-scratch-trace", "ab:main", "the ab-scratch comparison on the 64-request trace of the 1B shape (kvcli "
           "alone; its batched decode steps go through the int8 GEMM, which took its buffers from malloc per call too)",
           ("--before", "0377745", "throughput", "--rounds", "3", "--", "--shape", "1b", "--workload", "alpaca",
            "--num-requests", "64", "--compare", "none", "--llama-cpp", "none"), in_make_figures=False),
    Figure("ab-session-1b", "ab:main", "the roofline figure's 512-token prefill and decode on the 1B shape at dede958 "
           "(before the per-thread scratch, block order and adaptive draft length) and in this tree, interleaved",
           ("--before", "dede958", "roofline", "--rounds", "6", "--", "--contexts", "512", "--rounds", "1"),
           in_make_figures=False),
    Figure("ab-two-streams", "ab:main", "before/after: the bundled model's kvcli decode at ff7fd88 (a decode row's "
           "weights read as one stream per thread) and in this tree (two streams far apart), interleaved",
           ("--before", "ff7fd88", "decode", "--rounds", "6", "--", "--engines", "kvcli"), in_make_figures=False),
    Figure("ab-two-streams-1b", "ab:main", "the ab-two-streams comparison on the 1B shape: the roofline figure's "
           "512-token prefill and decode", ("--before", "ff7fd88", "roofline", "--rounds", "6", "--", "--contexts",
                                            "512", "--rounds", "1"), in_make_figures=False),
    Figure("ab-two-streams-kquant", "ab:main", "the two streams of the two-level forms (K-quants, Q8_0) at 75cdc5a "
           "(before: the one-level forms' alone) and in this tree, on the 1B shape in Q4_K_M: the roofline figure's "
           "512-token prefill and decode", ("--before", "75cdc5a", "roofline", "--rounds", "6", "--", "--kind",
                                            "Q4_K_M", "--contexts", "512", "--rounds", "1"), in_make_figures=False),
    Figure("ab-two-streams-kquant-avx2", "ab:main", "the ab-two-streams-kquant comparison held to AVX2 (kvcli's "
           "AVX2 build of the two-level loops' two streams; llama.cpp's AVX2 build)",
           ("--before", "75cdc5a", "roofline", "--rounds", "4", "--", "--kind", "Q4_K_M", "--contexts", "512",
            "--rounds", "1"), AVX2_ENV, in_make_figures=False),
    Figure("ab-two-streams-one-level-avx2", "ab:main", "the one-level loop's two streams in builds without the "
           "16-column loop (one_level_two8) at 08495a1 and in this tree, held to AVX2, on the 1B shape in Q4_0: the "
           "roofline figure's 512-token prefill and decode", ("--before", "08495a1", "roofline", "--rounds", "4", "--",
                                                              "--contexts", "512", "--rounds", "1"), AVX2_ENV,
           in_make_figures=False),
    Figure("ab-two-streams-spec", "ab:main", "the ab-two-streams comparison on the spec-default figure (speculation "
           "at batch 1, one thread: a verification's rows take the batch loops, plain decode's row the two streams)",
           ("--before", "ff7fd88", "spec-default", "--rounds", "4"), in_make_figures=False),
    Figure("ab-amx-spec", "ab:main", "the ab-amx-one-level comparison on the spec-default figure (speculation at "
           "batch 1 against plain decode; in the tree after, a verification's 8-bit vocabulary rows on AMX tiles from "
           "3 rows too)", ("--before", "faadf02", "spec-default", "--rounds", "3"), in_make_figures=False),
    Figure("ab-one-level-16-noamx", "ab:main", "the ab-amx-one-level comparison on the verify-step figure with AMX "
           "held off (the 16-column loop and the 9-row switch alone, as on AVX-512 CPUs without AMX)",
           ("--before", "faadf02", "verify-step", "--rounds", "3", "--", "--rounds", "5"), NOAMX_ENV,
           in_make_figures=False),
]}

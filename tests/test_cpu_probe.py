"""kernels/cpu_probe.c, the roofline benchmark's bounds: the read pass reads every byte it reports (its checksum
against a numpy fold of the same bytes, a byte changed anywhere changes it) and the dot-product loop runs every
instruction it counts (its sums against their closed form)."""

import numpy as np
import pytest
import torch
from cpu_paths import built, runnable_isas


@pytest.fixture(params=[i for i in runnable_isas() if i != "generic"])  # SIMD only: no plain C form
def lib(request):
    from kvcli_kernels.cpu_probe import load

    return built(load, request.param)


def _fold(buf: np.ndarray, width: int, threads: int) -> tuple[int, int]:
    """(checksum, bytes) kvp_read should give: per thread, the XOR of its share's vectors, lanes of 8 bytes
    summed mod 2^64; the threads' sums added."""
    step = 8 * width
    per = buf.nbytes // step // threads * step
    lanes = buf.view(np.uint64)
    total = 0
    for t in range(threads):
        share = lanes[t * per // 8:(t + 1) * per // 8].reshape(-1, width // 8)
        total += int(np.bitwise_xor.reduce(share, axis=0).astype(object).sum())
    return total % 2**64, per * threads


@pytest.mark.parametrize("threads", [1, 2])
def test_read_pass_reads_every_byte(lib, threads):
    from kvcli_kernels.cpu_probe import read_pass

    width = lib.kvp_read_width()
    g = torch.Generator().manual_seed(threads)
    nbytes = 8 * width * threads * 37 + 40  # a tail the pass leaves (not a whole step per thread)
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    _, done, check = read_pass(lib, buf, threads)
    want, want_bytes = _fold(buf.numpy(), width, threads)
    assert (check, done) == (want, want_bytes)
    for where in (0, want_bytes // 2 + 3, want_bytes - 1):
        changed = buf.clone()
        changed[where] ^= 0x5A
        assert read_pass(lib, changed, threads)[2] != check


@pytest.mark.parametrize("threads", [1, 2])
def test_int8_peak_runs_every_instruction(lib, threads):
    from kvcli_kernels.cpu_probe import int8_peak_instruction, int8_peak_pass

    iters, chains = 1000, 12
    _, macs, check = int8_peak_pass(lib, iters, threads, seed=0x01010101)
    # operands: bytes (1, 1, 1, 1) and (1, 1, 1, 0); chain c starts at c in every 32-bit lane
    what = int8_peak_instruction(lib)
    if "vpdpbusd" in what:  # 16 lanes of 32 bits, each + 3 per instruction
        per_thread, lane_macs = 16 * (sum(range(chains)) + chains * 3 * iters), 64
    else:  # vpmaddubsw: 16-bit lanes, the even ones start at c and add 2, the odd ones start at 0 and add 1
        per_thread, lane_macs = 8 * sum(range(chains)) + chains * 8 * 3 * iters, 32
    assert check == threads * per_thread
    assert macs == iters * chains * lane_macs * threads


@pytest.mark.parametrize("threads", [1, 2])
def test_fp32_peak_runs_every_instruction(lib, threads):
    from kvcli_kernels.cpu_probe import fp32_peak_instruction, fp32_peak_pass

    chains = 12
    lanes = 16 if "512-bit" in fp32_peak_instruction(lib) else 8
    # chain k starts at k and runs acc = acc / 2 + c (c = 1 + (seed & 0xFF)): after i steps 2c + (k - 2c) / 2^i
    for iters, seed in ((1, 1), (3, 5), (60, 2)):
        _, fmas, check = fp32_peak_pass(lib, iters, threads, seed)
        c = 1.0 + (seed & 0xFF)
        want = threads * lanes * sum(2 * c + (k - 2 * c) / 2 ** iters for k in range(chains))
        assert check == pytest.approx(want, rel=1e-6)
        assert fmas == iters * chains * lanes * threads

"""Would torch.compile help the decode step's small ops without moving a bit? Compiles the two kinds of
elementwise/row work the decoder layer does outside the matmuls and attention, at batch-16 decode
shapes of the bundled model: the rotary embedding (Rotary.apply on 12 q+k heads) and RMSNorm (576
wide). Prints whether the compiled results equal eager bit for bit on 20 random inputs, and the thread
CPU time per call of each (torch held to 1 thread).
"""

from __future__ import annotations

import os
import time
from datetime import datetime, timezone

import torch
import torch.nn.functional as F


def per_call_us(fn, n: int = 2000) -> float:
    fn()
    t = time.thread_time()
    for _ in range(n):
        fn()
    return (time.thread_time() - t) / n * 1e6


def main() -> None:
    torch.set_num_threads(1)
    from kvcli.bench.machine import machine_line
    from kvcli.model.layers import Rotary

    print(f"# torch.compile probe — {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(machine_line())
    print(f"load average (1 min): {os.getloadavg()[0]:.2f}")
    print("command: python scripts/probe_compile_bitwise.py")
    rot = Rotary(64, 8192, 100000.0, None, torch.device("cpu"))
    cos_sin = rot.at(torch.arange(500, 516), torch.float32)

    def rotary(x):
        return rot.apply(x, cos_sin)

    def rms_norm(h, w):
        return F.rms_norm(h, (h.shape[-1],), w, 1e-5)

    t0 = time.perf_counter()
    c_rotary, c_norm = torch.compile(rotary, dynamic=False), torch.compile(rms_norm, dynamic=False)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(576, generator=g)
    same_r = same_n = 0
    with torch.inference_mode():
        for _ in range(20):
            x, h = torch.randn(16, 12, 64, generator=g), torch.randn(16, 576, generator=g)
            same_r += torch.equal(c_rotary(x), rotary(x))
            same_n += torch.equal(c_norm(h, w), rms_norm(h, w))
        print(f"compile + checks: {time.perf_counter() - t0:.0f} s wall")
        print(f"bitwise equal to eager: rotary {same_r}/20, rms_norm {same_n}/20")
        x, h = torch.randn(16, 12, 64), torch.randn(16, 576)
        for name, eager, compiled, args in (("rotary", rotary, c_rotary, (x,)), ("rms_norm", rms_norm, c_norm, (h, w))):
            e = min(per_call_us(lambda: eager(*args)) for _ in range(3))
            c = min(per_call_us(lambda: compiled(*args)) for _ in range(3))
            print(f"{name:<9} eager {e:6.1f} us/call, compiled {c:6.1f} us/call (best of 3)")


if __name__ == "__main__":
    main()

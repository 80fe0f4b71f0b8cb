"""Scratch buffers the CPU paths reuse between calls (dense read-backs of a weight, unpacked codes, the
one-call decode's activations): one pool per process, keyed by a name, so a decode step allocates
nothing once warm. A buffer's contents are valid until the next request for the same name."""

from __future__ import annotations

import torch

_buffers: dict[tuple[str, bool], torch.Tensor] = {}


def scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu",
            keep_bytes: int | None = None) -> torch.Tensor:
    """A tensor of `shape` backed by the buffer `name`, grown (with a quarter to spare) when too small.
    With keep_bytes, a buffer larger than that is handed out but not kept. Buffers made under
    torch.inference_mode are inference tensors, which cannot be written outside it: one pool per mode."""
    n = 1
    for x in shape:
        n *= x
    key = (name, torch.is_inference_mode_enabled())
    buf = _buffers.get(key)
    if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != torch.device(device):
        buf = torch.empty(n + n // 4, dtype=dtype, device=device)
        if keep_bytes is None or buf.numel() * buf.element_size() <= keep_bytes:
            _buffers[key] = buf
    return buf[:n].view(shape)


def held_bytes() -> int:
    """Bytes the pool holds now (for memory accounting)."""
    return sum(b.numel() * b.element_size() for b in _buffers.values())

"""Every attention backend answers every method of the AttentionBackend protocol (kvcli/attention/base.py),
optional features included (None where it lacks one): the engine asks them whatever the device, and a
backend missing one failed only on a GPU (decode_graph_key on the torch backend)."""

from __future__ import annotations

import inspect

import pytest

from kvcli.attention.base import AttentionBackend
from kvcli.attention.invariant_backend import InvariantAttentionBackend
from kvcli.attention.torch_backend import TorchAttentionBackend

PROTOCOL = [n for n, v in vars(AttentionBackend).items() if inspect.isfunction(v) and not n.startswith("_")]


def _backends():
    out = [TorchAttentionBackend(), InvariantAttentionBackend()]
    try:
        from kvcli.attention.triton_backend import TritonAttentionBackend
    except ImportError:
        return out
    return out + [TritonAttentionBackend()]


@pytest.mark.parametrize("backend", _backends(), ids=lambda b: b.name)
def test_backend_has_every_protocol_method(backend):
    assert {"write_kv", "forward", "rope_kv_writer", "native_decode_plan", "decode_graph_key"} <= set(PROTOCOL)
    missing = [n for n in PROTOCOL if not callable(getattr(backend, n, None))]
    assert not missing, f"{backend.name} lacks {missing}"


@pytest.mark.parametrize("backend", [TorchAttentionBackend(), InvariantAttentionBackend()], ids=lambda b: b.name)
def test_host_looping_backends_refuse_cuda_graphs(backend):
    assert backend.decode_graph_key(1, 100, None, 8, None) is None

"""Simple Q4_K / Q6_K encoders (numpy), for test files and the K-quant benchmark.

gguf-py decodes K-quants but cannot encode them. These are honest round-to-nearest encoders with
min/max scales per sub-block, not llama.cpp's error-minimising search (its files quantize better;
the layouts are the same, which is what kvcli's loader reads). Block layouts: kquants.py.
"""

from __future__ import annotations

import functools
import os

import numpy as np

QK_K = 256


def open_reader(path):
    """gguf-py's GGUFReader of `path`, parsed once per process while the file is unchanged (same size and
    mtime). Its parse of the bundled model's 49,152-token vocabulary takes ~3 s, and tests and benchmarks write
    dozens of variants from one source file. The reader is read-only (mode "r"): callers share it."""
    st = os.stat(path)
    return _reader(os.fspath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _reader(path: str, size: int, mtime_ns: int):
    import gguf

    return gguf.GGUFReader(path, "r")


def _blocks(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] % QK_K:
        raise ValueError(f"K-quants need rows that are a multiple of {QK_K} (got {x.shape[-1]})")
    return x.reshape(-1, QK_K)


def _round_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b == 0, 0, np.rint(a / np.where(b == 0, 1, b)))


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """float [..., K] -> uint8 [..., K // 256 * 144]."""
    b = _blocks(x)
    nb = b.shape[0]
    g = b.reshape(nb, 8, 32)
    lo = np.minimum(g.min(-1), 0.0)  # Q4_K subtracts a non-negative dmin * m
    scale = (g.max(-1) - lo) / 15
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (-lo.min(-1) / 63).astype(np.float16)
    sc = np.clip(_round_div(scale, d.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(_round_div(-lo, dmin.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    eff_d = d.astype(np.float32)[:, None] * sc
    eff_m = dmin.astype(np.float32)[:, None] * m
    q = np.clip(_round_div(g + eff_m[..., None], eff_d[..., None]), 0, 15).astype(np.uint8)
    scales = np.empty((nb, 12), dtype=np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    q = q.reshape(nb, 4, 2, 32)  # element 64 c + 32 s + j
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(nb, 128)
    out = np.concatenate([d.reshape(nb, 1).view(np.uint8), dmin.reshape(nb, 1).view(np.uint8), scales, qs], axis=1)
    return out.reshape(*np.shape(x)[:-1], -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """float [..., K] -> uint8 [..., K // 256 * 210]."""
    b = _blocks(x)
    nb = b.shape[0]
    g = b.reshape(nb, 16, 16)
    scale = np.abs(g).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16)
    sc = np.clip(_round_div(scale, d.astype(np.float32)[:, None]), -128, 127).astype(np.int8)
    eff = d.astype(np.float32)[:, None] * sc.astype(np.float32)
    q = (np.clip(_round_div(g, eff[..., None]), -32, 31) + 32).astype(np.uint8).reshape(nb, 2, 128)
    lo, hi = q & 0x0F, q >> 4
    ql = (lo[:, :, :64] | (lo[:, :, 64:] << 4)).reshape(nb, 128)  # element 128 h + 64 s + j
    h4 = hi.reshape(nb, 2, 4, 32)  # element 128 h + 32 t + j
    qh = (h4[:, :, 0] | (h4[:, :, 1] << 2) | (h4[:, :, 2] << 4) | (h4[:, :, 3] << 6)).reshape(nb, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), d.reshape(nb, 1).view(np.uint8)], axis=1)
    return out.reshape(*np.shape(x)[:-1], -1)


def random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator, scale: float = 0.01) -> np.ndarray:
    """Random but well-formed blocks of a GGML type: random bytes with finite fp16 d (and dmin/m).
    `scale` sets the fp16 fields' magnitude (d ~ scale / 32 for K-quant super-block scales)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    nb = cols // block
    raw = rng.integers(0, 256, (rows, nb, size), dtype=np.uint8)
    k_quant = type_name.endswith("_K")
    fields = {"Q6_K": [208], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q4_1": [0, 2], "Q5_1": [0, 2]}.get(type_name, [0])
    for i, off in enumerate(fields):
        v = rng.uniform(0.5, 1.5, (rows, nb)) * (scale / 32 if k_quant else scale)
        if i == 1 and not k_quant:  # Q4_1 / Q5_1 min: negative, about half the code range
            v = -v * (16 if type_name == "Q5_1" else 8)
        raw[..., off:off + 2] = v.astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    return raw.reshape(rows, nb * size)


# --- Writing GGUF files (tests, benchmarks) -------------------------------------------------------

def encode(x: np.ndarray, type_name: str) -> np.ndarray:
    """float32 [N, K] -> the raw blocks of `type_name` (or the float array itself for F32/F16)."""
    import gguf

    if type_name == "F32":
        return np.asarray(x, dtype=np.float32)
    if type_name == "F16":
        return np.asarray(x, dtype=np.float16)
    if type_name == "Q4_K":
        return quantize_q4_k(x)
    if type_name == "Q6_K":
        return quantize_q6_k(x)
    return gguf.quants.quantize(np.asarray(x, dtype=np.float32), gguf.GGMLQuantizationType[type_name])


def copy_fields(reader, writer, keep) -> None:
    """Copy the key/value fields of an open GGUFReader whose key satisfies keep(key) into a GGUFWriter."""
    import gguf

    V = gguf.GGUFValueType
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or not keep(key):
            continue
        main = f.types[0]
        writer.add_key_value(key, f.contents(), main, sub_type=f.types[-1] if main == V.ARRAY else None)


def add_tensor(writer, name: str, data: np.ndarray, type_name: str) -> None:
    import gguf

    if type_name in ("F32", "F16"):
        writer.add_tensor(name, data)
    else:
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[type_name])


def finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def reencode_gguf(src: str, dst: str, type_for) -> dict[str, int]:
    """Rewrite a GGUF with each tensor re-encoded as type_for(name, shape, old_type) (None = keep the
    tensor as it is). Quantized sources are dequantized by gguf-py first. Returns tensors per new type."""
    import gguf

    reader = open_reader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    copy_fields(reader, writer, keep=lambda key: key != "general.file_type")
    counts: dict[str, int] = {}
    for t in reader.tensors:
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # numpy order: [N, K]
        new = type_for(t.name, shape, t.tensor_type.name)
        if new is None or new == t.tensor_type.name:
            new = t.tensor_type.name
            data = np.array(t.data)
            if new not in ("F32", "F16"):
                data = data.reshape(shape[0] if len(shape) > 1 else 1, -1)
        else:
            x = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
            data = encode(x, new)
        add_tensor(writer, t.name, data, new)
        counts[new] = counts.get(new, 0) + 1
    finish(writer)
    return counts


def q4_k_m_type(name: str, shape: tuple[int, ...], old: str) -> str | None:
    """llama.cpp's Q4_K_M choice, simplified: Q6_K for attn_v and ffn_down (llama.cpp: on about half
    the layers), Q4_K for the other linears; a tensor whose rows are not a multiple of 256 takes
    llama.cpp's fallback (Q4_K -> Q5_0, Q6_K -> Q8_0). Norms stay F32, the embedding as it is."""
    if len(shape) < 2 or not name.startswith("blk."):
        return None
    want = "Q6_K" if name.endswith(("attn_v.weight", "ffn_down.weight")) else "Q4_K"
    if shape[-1] % QK_K:
        return {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}[want]
    return want

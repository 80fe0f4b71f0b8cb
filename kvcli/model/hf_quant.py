"""Hugging Face pre-quantized INT4 checkpoints -> kvcli's canonical "q4" QuantTensor, without a dense copy.

Every format below stores, per linear W [N out, K in], 4-bit codes q, a scale s per (row, group of G
inputs) and a zero point z in code space, and dequantizes w = (q - z) * s. kvcli keeps the codes
(re-packed into its nibble layout), the file's scales as stored, and z as a uint8 per group:
QuantTensor's min is then -(z * s), multiplied out in float32 where it is exact (a 5-bit integer
times an 11-bit fp16 / 8-bit bf16 mantissa), so QuantTensor.dequantize gives (q - z) * s exactly and
the linears run through the same INT4 paths as GGUF Q4_1 (torch's int4 CPU kernel, the Triton GEMM,
the exact torch fallback). Symmetric files (z = 8 everywhere) keep min = -8 s in the scale's own
dtype instead, exact there too.

Published layouts (int32 words, nibble i = bits 4i .. 4i + 3):
  AWQ, version "gemm" (AutoAWQ)   qweight [K, N/8], qzeros [K/G, N/8]: packed along N, nibble i of
                                   word j holds column 8j + (0, 2, 4, 6, 1, 3, 5, 7)[i];
                                   scales [K/G, N]. z as stored.
  GPTQ (AutoGPTQ / GPTQModel)      qweight [K/8, N]: packed along K, nibble i of word j holds row
                                   8j + i; qzeros [K/G, N/8]: packed along N in order; scales
                                   [K/G, N]; g_idx [K]. checkpoint_format "gptq" (v1, the default)
                                   stores z - 1 (the historical off-by-one: z = nibble + 1, element
                                   by element, as AutoGPTQ's own dequantization); "gptq_v2" stores z.
  compressed-tensors               weight_packed [N, K/8]: packed along K in order, codes stored
  "pack-quantized" (W4A16)         + 8 (signed -8..7 -> 0..15); weight_scale [N, K/G];
                                   weight_zero_point [N/8, K/G] (asymmetric only): packed along N,
                                   also + 8. Symmetric: z = 0 on the signed codes, i.e. 8 on stored ones.

Refused with one line: bits other than 4, act-order (a g_idx that is not k // G), group sizes other
than 32/64/128, AWQ versions other than "gemm", other GPTQ checkpoint formats, compressed-tensors
formats other than pack-quantized or schemes that quantize activations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcli.model.quant import QuantTensor, pack_nibbles

GROUP_SIZES = (32, 64, 128)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8j + AWQ_ORDER[i]
# Tensor suffixes each format stores in place of `<module>.weight`.
SUFFIXES = {
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"),
}


class HFQuantError(ValueError):
    """A pre-quantized checkpoint kvcli does not read; the message names what and why."""


@dataclass(frozen=True)
class HFQuantScheme:
    method: str  # "awq" | "gptq" | "compressed-tensors"
    group_size: int  # from the config; every tensor's own shape is checked against it
    zero_bias: int = 0  # added to every stored zero nibble (GPTQ v1: 1)
    sym: bool = False  # GPTQ sym=True: zeros all 8, so min = -8 s stays in the scale's dtype
    label: str = ""  # what `formats` / inspect call it, e.g. "gptq-v1 int4 g128 sym"


def _check_group(g: object, what: str) -> int:
    if g not in GROUP_SIZES:
        raise HFQuantError(f"{what}: group_size {g} is not supported (kvcli reads 32, 64 or 128)")
    return int(g)  # type: ignore[arg-type]


def parse_scheme(qc: dict, where: str) -> HFQuantScheme:
    """config.json's quantization_config -> the scheme, or HFQuantError naming the unsupported option."""
    method = str(qc.get("quant_method", "")).lower()
    if method == "awq":
        if qc.get("bits", qc.get("w_bit", 4)) != 4:
            raise HFQuantError(f"{where}: AWQ with bits={qc.get('bits', qc.get('w_bit'))} is not supported (4 only)")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise HFQuantError(f"{where}: AWQ version {version!r} is not supported (kvcli reads the GEMM packing)")
        if not qc.get("zero_point", True):
            raise HFQuantError(f"{where}: AWQ without zero points (zero_point: false) is not supported")
        g = _check_group(qc.get("group_size", qc.get("q_group_size")), f"{where}: AWQ")
        return HFQuantScheme("awq", g, 0, False, f"awq-gemm int4 g{g}")
    if method == "gptq":
        if qc.get("bits") != 4:
            raise HFQuantError(f"{where}: GPTQ with bits={qc.get('bits')} is not supported (4 only)")
        fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise HFQuantError(f"{where}: GPTQ checkpoint_format {fmt!r} is not supported (gptq or gptq_v2)")
        g = _check_group(qc.get("group_size"), f"{where}: GPTQ")
        sym = "sym" if qc.get("sym", True) else "asym"
        # desc_act alone is not refused here: a g_idx equal to k // G is plain grouping (checked per tensor).
        return HFQuantScheme("gptq", g, 1 if fmt == "gptq" else 0, sym == "sym",
                             f"gptq-{'v1' if fmt == 'gptq' else 'v2'} int4 g{g} {sym}")
    if method == "compressed-tensors":
        fmt = str(qc.get("format", "")).lower()
        groups = qc.get("config_groups") or {}
        if not groups:
            raise HFQuantError(f"{where}: compressed-tensors config without config_groups")
        sizes = set()
        for name, grp in groups.items():
            fmt_g = str(grp.get("format") or fmt).lower()
            if fmt_g != "pack-quantized":
                raise HFQuantError(f"{where}: compressed-tensors format {fmt_g!r} is not supported "
                                   "(kvcli reads pack-quantized W4A16)")
            w = grp.get("weights") or {}
            if w.get("num_bits") != 4 or w.get("type", "int") != "int":
                raise HFQuantError(f"{where}: compressed-tensors group {name!r}: {w.get('type', 'int')} "
                                   f"num_bits={w.get('num_bits')} is not supported (int 4 only)")
            if grp.get("input_activations"):
                raise HFQuantError(f"{where}: compressed-tensors group {name!r} quantizes activations "
                                   "(kvcli reads weight-only W4A16)")
            if w.get("strategy") != "group":
                raise HFQuantError(f"{where}: compressed-tensors strategy {w.get('strategy')!r} is not supported "
                                   "(group only)")
            sizes.add(_check_group(w.get("group_size"), f"{where}: compressed-tensors"))
        g = sizes.pop() if len(sizes) == 1 else 0  # 0: several sizes, each tensor's from its scales
        return HFQuantScheme("compressed-tensors", g, 0, False, f"compressed-tensors int4 g{g or 'mixed'}")
    raise HFQuantError(f"{where}: quantization_config.quant_method {method or None!r} is not supported "
                       "(kvcli reads awq, gptq, compressed-tensors and, with bitsandbytes installed, "
                       "bitsandbytes 4-bit)")


# --- unpacking: int32 words -> uint8 codes in 0..15 -----------------------------------------------

def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., W, 8]: nibble i of each word (arithmetic shift, then masked).
    One shift at a time, so the only int32 temporary is the size of the packed words (not 8x)."""
    out = torch.empty((*words.shape, 8), dtype=torch.uint8, device=words.device)
    for i in range(8):
        out[..., i] = (words >> (4 * i)) & 0xF
    return out


def unpack_along_last(words: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[R, W] words packed along the last dim -> [R, 8 W] codes; nibble i holds element 8j + order[i]."""
    n = _nibbles(words)
    if order is not None:
        inv = [order.index(c) for c in range(8)]  # element c sits in nibble inv[c]
        n = n[..., inv]
    return n.reshape(words.shape[0], -1)


def unpack_along_first(words: torch.Tensor) -> torch.Tensor:
    """[W, C] words packed along the first dim (nibble i of word j = row 8j + i) -> [8 W, C] codes."""
    n = _nibbles(words)  # [W, C, 8]
    return n.permute(0, 2, 1).reshape(-1, words.shape[1])


# --- one linear ------------------------------------------------------------------------------------

def to_quant_tensor(codes: torch.Tensor, scale: torch.Tensor, zeros: torch.Tensor | int, group_size: int,
                    ) -> QuantTensor:
    """codes uint8 [N, K] (0..15), scale [N, K/G] as stored, zeros [N, K/G] (ints) or one int for all
    -> QuantTensor with dequantize() == (codes - zeros) * scale exactly."""
    s32 = scale.to(torch.float32)
    if isinstance(zeros, int):
        mn = -(float(zeros) * s32)
        kept = mn.to(scale.dtype)
        # -8 s is exact in the scale's dtype unless it overflows: keep the file's precision then.
        mn = kept if torch.equal(kept.to(torch.float32), mn) else mn
        return QuantTensor("q4", pack_nibbles(codes), scale.contiguous(), mn.contiguous(), group_size)
    # A uint8 zero point per group (1 byte, against 4 for an exact float32 min = -zero * scale).
    return QuantTensor("q4", pack_nibbles(codes), scale.contiguous(), None, group_size,
                       zero=zeros.to(torch.uint8).contiguous())


def _group_size(n_groups: int, k: int, scheme: HFQuantScheme, name: str) -> int:
    g = k // n_groups if n_groups and k % n_groups == 0 else 0
    if g not in GROUP_SIZES or (scheme.group_size and g != scheme.group_size):
        raise HFQuantError(f"{name}: {n_groups} scale groups over {k} inputs do not match group_size "
                           f"{scheme.group_size or 'of 32/64/128'}")
    return g


def _check_g_idx(g_idx: torch.Tensor | None, k: int, g: int, name: str) -> None:
    if g_idx is None:
        return
    trivial = torch.arange(k, device=g_idx.device) // g
    if g_idx.shape != (k,) or not torch.equal(g_idx.to(torch.int64), trivial):
        raise HFQuantError(f"{name}: act-order (desc_act) checkpoints are not supported: g_idx reorders "
                           "the input groups")


def _awq(p: str, t: dict[str, torch.Tensor], s: HFQuantScheme) -> QuantTensor:
    q = unpack_along_last(t[p + "qweight"], AWQ_ORDER)  # [K, N]
    k = q.shape[0]
    g = _group_size(t[p + "scales"].shape[0], k, s, p + "scales")
    z = unpack_along_last(t[p + "qzeros"], AWQ_ORDER)  # [K/G, N]
    return to_quant_tensor(q.t().contiguous(), t[p + "scales"].t(), z.t(), g)


def _gptq(p: str, t: dict[str, torch.Tensor], s: HFQuantScheme) -> QuantTensor:
    q = unpack_along_first(t[p + "qweight"])  # [K, N]
    k = q.shape[0]
    g = _group_size(t[p + "scales"].shape[0], k, s, p + "scales")
    _check_g_idx(t.get(p + "g_idx"), k, g, p + "g_idx")
    z = unpack_along_last(t[p + "qzeros"]).to(torch.int16) + s.zero_bias  # [K/G, N]; v1: 1..16
    zeros: torch.Tensor | int = 8 if s.sym and bool((z == 8).all()) else z.t()
    return to_quant_tensor(q.t().contiguous(), t[p + "scales"].t(), zeros, g)


def _compressed(p: str, t: dict[str, torch.Tensor], s: HFQuantScheme) -> QuantTensor:
    q = unpack_along_last(t[p + "weight_packed"])  # [N, 8 ceil(K/8)]
    scale = t[p + "weight_scale"]
    shape = t.get(p + "weight_shape")
    n, k = (int(shape[0]), int(shape[1])) if shape is not None else (q.shape[0], q.shape[1])
    if k != q.shape[1] or n != q.shape[0]:
        raise HFQuantError(f"{p}weight_packed: shape {n}x{k} is not whole words of 8 codes")
    g = _group_size(scale.shape[1], k, s, p + "weight_scale")
    _check_g_idx(t.get(p + "weight_g_idx"), k, g, p + "weight_g_idx")
    zp = t.get(p + "weight_zero_point")
    if zp is None or zp.numel() == 0:
        return to_quant_tensor(q, scale, 8, g)  # symmetric: signed code 0 is stored 8
    if zp.dtype != torch.int32:
        raise HFQuantError(f"{p}weight_zero_point: {zp.dtype} is not the packed int32 layout")
    z = unpack_along_first(zp)[:n]  # [N, K/G], + 8 like the codes: it cancels in q - z
    return to_quant_tensor(q, scale, z, g)


_DECODERS = {"awq": _awq, "gptq": _gptq, "compressed-tensors": _compressed}
_MARKER = {"awq": "qweight", "gptq": "qweight", "compressed-tensors": "weight_packed"}


def convert(raw: dict[str, torch.Tensor], scheme: HFQuantScheme) -> tuple[dict[str, QuantTensor | torch.Tensor],
                                                                         dict[str, int]]:
    """All tensors of a checkpoint -> kvcli weights by HF name (`<module>.weight`) and counts per format.
    Tensors of layers the format left unquantized (embeddings, norms, lm_head, ignored linears) stay
    as stored. `raw` is consumed (each packed tensor is dropped once converted)."""
    marker = _MARKER[scheme.method]
    prefixes = [name[: -len(marker)] for name in raw if name.endswith("." + marker)]
    weights: dict[str, QuantTensor | torch.Tensor] = {}
    formats: dict[str, int] = {}
    for p in prefixes:
        missing = [p + x for x in SUFFIXES[scheme.method][:3] if p + x not in raw]
        missing = [m for m in missing if not m.endswith("weight_zero_point")]
        if missing:
            raise HFQuantError(f"{missing[0]}: missing (the {scheme.method} layout stores it beside {p}{marker})")
        try:
            weights[p + "weight"] = _DECODERS[scheme.method](p, raw, scheme)
        except (IndexError, RuntimeError) as e:  # shapes that do not fit the published layout
            raise HFQuantError(f"{p}{marker}: not the {scheme.method} layout ({e})") from None
        for x in SUFFIXES[scheme.method]:
            raw.pop(p + x, None)
        formats[scheme.label] = formats.get(scheme.label, 0) + 1
    for name, tensor in raw.items():
        weights[name] = tensor
        key = f"dense:{str(tensor.dtype).replace('torch.', '')}"
        formats[key] = formats.get(key, 0) + 1
    return weights, formats

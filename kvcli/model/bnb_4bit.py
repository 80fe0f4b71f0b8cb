"""bitsandbytes 4-bit (NF4 / FP4) checkpoints as transformers saves them, kept in bitsandbytes' own form.

NF4/FP4 codes index a 16-entry table (not an affine grid), so they cannot become kvcli's INT4
layout exactly; the packed bytes and the quantization state are held as saved and the linears run
bitsandbytes' matmul_4bit, like `--quant nf4` does for a dense checkpoint. Per linear, transformers
writes `<module>.weight` (uint8, two codes a byte), `.weight.absmax`, `.weight.quant_map`,
`.weight.quant_state.bitsandbytes__nf4|fp4` (the small fields, serialized) and, with double
quantization, `.weight.nested_absmax` / `.weight.nested_quant_map`; bitsandbytes' QuantState.from_dict
reads them back. 8-bit (LLM.int8) checkpoints are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_STATE = ".weight.quant_state.bitsandbytes__"


class BnbError(ValueError):
    """A bitsandbytes checkpoint kvcli does not read; the message names what and why."""


@dataclass
class Bnb4bitWeight:
    """One linear's packed 4-bit weight and its bitsandbytes QuantState (shape, blocks, absmax, table)."""

    packed: torch.Tensor  # uint8 [N * K / 2, 1]
    state: object  # bitsandbytes.functional.QuantState

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.state.shape)  # type: ignore[attr-defined,return-value]

    @property
    def quant_type(self) -> str:
        return str(self.state.quant_type)  # type: ignore[attr-defined]

    @property
    def nbytes(self) -> int:
        s = self.state
        parts = [self.packed, s.absmax, s.code]  # type: ignore[attr-defined]
        if s.state2 is not None:  # type: ignore[attr-defined]
            parts += [s.state2.absmax, s.state2.code]  # type: ignore[attr-defined]
        return sum(t.numel() * t.element_size() for t in parts)

    def to(self, device: torch.device | str) -> "Bnb4bitWeight":
        self.state.to(device)  # type: ignore[attr-defined]  # QuantState moves in place
        return Bnb4bitWeight(self.packed.to(device), self.state)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        import bitsandbytes.functional as bnbf

        return bnbf.dequantize_4bit(self.packed, self.state).to(dtype)


def check_config(qc: dict, where: str) -> None:
    if qc.get("load_in_8bit") or qc.get("_load_in_8bit"):
        raise BnbError(f"{where}: bitsandbytes 8-bit (LLM.int8) checkpoints are not supported (4-bit only)")
    if not (qc.get("load_in_4bit") or qc.get("_load_in_4bit")):
        raise BnbError(f"{where}: bitsandbytes quantization_config without load_in_4bit")
    storage = str(qc.get("bnb_4bit_quant_storage", "uint8"))
    if storage != "uint8":
        raise BnbError(f"{where}: bitsandbytes bnb_4bit_quant_storage {storage!r} is not supported (uint8 only)")


def convert(raw: dict[str, torch.Tensor]) -> tuple[dict[str, Bnb4bitWeight | torch.Tensor], dict[str, int]]:
    """All tensors of a bitsandbytes 4-bit checkpoint -> weights by HF name and counts per format.
    Tensors of layers left unquantized stay as stored; `raw` is consumed."""
    import bitsandbytes.functional as bnbf

    modules = sorted({name[: name.index(_STATE)] for name in raw if _STATE in name})
    weights: dict[str, Bnb4bitWeight | torch.Tensor] = {}
    formats: dict[str, int] = {}
    for m in modules:
        prefix = m + ".weight."
        if m + ".weight" not in raw:
            raise BnbError(f"{m}.weight: missing (its bitsandbytes quant_state is there)")
        parts = {name[len(prefix):]: raw.pop(name) for name in [n for n in raw if n.startswith(prefix)]}
        try:
            state = bnbf.QuantState.from_dict(parts, device=torch.device("cpu"))
        except (ValueError, KeyError, AssertionError) as e:
            raise BnbError(f"{m}.weight: unreadable bitsandbytes quant_state ({e})") from None
        w = Bnb4bitWeight(raw.pop(m + ".weight"), state)
        weights[m + ".weight"] = w
        key = f"bnb-{w.quant_type} blocksize {state.blocksize}" + (" double-quant" if state.nested else "")
        formats[key] = formats.get(key, 0) + 1
    for name, tensor in raw.items():
        weights[name] = tensor
        key = f"dense:{str(tensor.dtype).replace('torch.', '')}"
        formats[key] = formats.get(key, 0) + 1
    return weights, formats

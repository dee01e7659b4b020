"""bitsandbytes' serialized weights (as transformers' `save_pretrained` writes a model loaded with
`BitsAndBytesConfig`), decoded in plain torch: the bitsandbytes package is not needed to read them.

4-bit (nf4 / fp4), the tensors of a weight W [N, K] named "<module>.weight":
  weight                                    uint8 [ceil(N * K / 2), 1] (or those bytes viewed as the
                                            bnb_4bit_quant_storage dtype): the 4-bit codes of W flattened row-major,
                                            two per byte, element 2 i in the high nibble, 2 i + 1 in the low one
  weight.absmax                             float32 [num_blocks]: one scale per `blocksize` consecutive elements of
                                            the flattened W (the last block may be short); with double quantization
                                            uint8 codes of the scales minus `nested_offset`
  weight.quant_map                          float32 [16]: the value of each code, the quant_type's table (checked;
                                            bitsandbytes' CUDA kernels use their built-in tables, as done here)
  weight.nested_absmax, .nested_quant_map   double quantization: float32 [ceil(num_blocks / nested_blocksize)] and
                                            float32 [256]; scale b = nested_quant_map[absmax[b]] *
                                            nested_absmax[b // nested_blocksize] + nested_offset
  weight.quant_state.bitsandbytes__<type>   uint8 bytes of a JSON object: quant_type, blocksize, dtype, shape [N, K],
                                            and with double quantization nested_blocksize, nested_dtype,
                                            nested_offset
  W[i] = quant_map[code[i]] * scale[i // blocksize] (i: the row-major flat index), in float32.
8-bit (LLM.int8): weight int8 [N, K], "<module>.SCB" float32 [N] (each row's absmax), "<module>.weight_format" (0: row
major, the only layout written by current versions); W[n, k] = weight[n, k] * SCB[n] / 127.

Decoded form kept by the 4-bit method while loading: codes uint8 [N, ceil(K / 2)] packed along each row (feature 2 j
in the high nibble of byte j, 2 j + 1 in the low one: for an even K the checkpoint's bytes as they are, reshaped) and
scales float32 [N, K / g], one per
g = gcd(K, 64) consecutive features of a row: a block boundary (a multiple of blocksize, itself a multiple of 64, in the
flat index) falls inside a row only at a multiple of g, so each run of g features has one scale (any divisor of g
works as well: a tensor-parallel rank with K / tp input features keeps gcd(K / tp, 64))."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator

import torch

SCALE_UNIT = 64  # blocksizes must be multiples of this (bitsandbytes writes 64 .. 4096)
STATE_KEY = "quant_state.bitsandbytes__"
QUANT_TYPES = ("nf4", "fp4")
STORAGE_DTYPES = ("uint8", "int8", "float16", "bfloat16", "float32")
COMPONENTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
# bitsandbytes' nf4 table (get_4bit_type("nf4")): quantiles of N(0, 1), sorted
NF4 = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip
# fp4 (get_4bit_type("fp4")): 1 sign, 2 exponent and 1 mantissa bits, in bit-pattern order, divided by its largest
FP4_UNSCALED = (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, -0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0)


def codebook(quant_type: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 float32 values of the codes of `quant_type` ("nf4" | "fp4"), as bitsandbytes computes them."""
    if quant_type == "nf4":
        return torch.tensor(NF4, dtype=torch.float32, device=device)
    table = torch.tensor(FP4_UNSCALED, dtype=torch.float32, device=device)
    return table.div_(table.abs().max())


def scale_group(k: int) -> int:
    """g: the input features per kept scale of a layer with k input features."""
    return math.gcd(k, SCALE_UNIT)


def split_name(name: str) -> tuple[str, str] | None:
    """("<module>", component) of a 4-bit checkpoint tensor name ("weight", "absmax", ..., "quant_state"), or None
    for any other tensor."""
    module, sep, rest = name.partition(".weight.")
    if sep:
        if rest in COMPONENTS:
            return module, rest
        if rest.startswith(STATE_KEY):
            return module, "quant_state"
        return None
    if name.endswith(".weight"):
        return name[: -len(".weight")], "weight"
    return None


def parse_state(module: str, blob: torch.Tensor, quant_type: str) -> dict:
    """The quant_state JSON of `module`, checked for what this decoder reads (and against the config's quant_type)."""
    state = json.loads(bytes(blob.cpu().to(torch.uint8).numpy()).decode("utf-8"))
    where = f"{module}.weight.quant_state"
    if state.get("quant_type") != quant_type:
        raise ValueError(
            f"{where}: quant_type={state.get('quant_type')!r} differs from quantization_config.bnb_4bit_quant_type="
            f"{quant_type!r} (supported: one of {QUANT_TYPES} for every layer)"
        )
    blocksize = state.get("blocksize")
    if type(blocksize) is not int or blocksize <= 0 or blocksize % SCALE_UNIT:
        raise ValueError(f"{where}: blocksize={blocksize!r} is not supported (supported: multiples of {SCALE_UNIT})")
    shape = state.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2 and all(type(s) is int and s > 0 for s in shape)):
        raise ValueError(f"{where}: shape={shape!r} is not supported (supported: a 2-D linear weight)")
    return state


def block_scales(module: str, parts: dict[str, torch.Tensor], state: dict) -> torch.Tensor:
    """float32 [num_blocks]: each block's scale (double quantization undone)."""
    absmax = parts["absmax"]
    if "nested_offset" not in state:
        return absmax.float().reshape(-1)
    nested_bs = state.get("nested_blocksize")
    if type(nested_bs) is not int or nested_bs <= 0:
        raise ValueError(f"{module}.weight.quant_state: nested_blocksize={nested_bs!r} must be a positive integer")
    codes = absmax.reshape(-1).long()
    nested = parts["nested_absmax"].float().reshape(-1)
    blocks = torch.arange(codes.numel(), device=codes.device) // nested_bs
    out = parts["nested_quant_map"].float().reshape(-1)[codes] * nested[blocks]  # as bitsandbytes: float32
    return out + torch.tensor(float(state["nested_offset"]), dtype=torch.float32)


def pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [N, K] -> [N, ceil(K / 2)], two per byte along each row (even feature in the high nibble)."""
    codes = torch.nn.functional.pad(codes, (0, codes.shape[1] % 2))
    return (codes[:, 0::2] << 4) | codes[:, 1::2]


def unpack_rows(packed: torch.Tensor, k: int) -> torch.Tensor:
    """The inverse of pack_rows: [N, ceil(K / 2)] -> codes uint8 [N, K]."""
    return torch.stack([packed >> 4, packed & 0xF], dim=2).reshape(packed.shape[0], -1)[:, :k]


def decode_4bit(module: str, parts: dict[str, torch.Tensor], state: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [N, ceil(K / 2)] packed along rows, scales float32 [N, K / g]) of one 4-bit weight's tensors and
    its parsed quant_state."""
    (n, k), blocksize = state["shape"], state["blocksize"]
    packed = parts["weight"].contiguous().view(torch.uint8).reshape(-1)
    numel, num_blocks = n * k, -(-n * k // blocksize)
    if packed.numel() != -(-numel // 2):
        raise ValueError(f"{module}.weight: {packed.numel()} bytes do not hold a 4-bit weight of shape [{n}, {k}]")
    if k % 2 == 0:  # each row's pairs of features are whole bytes of the flat packing
        codes = packed.reshape(n, k // 2)
    else:
        codes = pack_rows(torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)[:numel].reshape(n, k))
    absmax = block_scales(module, parts, state)
    if absmax.numel() != num_blocks:
        raise ValueError(f"{module}.weight.absmax: {absmax.numel()} scales, expected {num_blocks} blocks")
    table = parts["quant_map"].float().reshape(-1)
    if table.shape != (16,) or not torch.equal(table.cpu(), codebook(state["quant_type"])):
        raise ValueError(
            f"{module}.weight.quant_map={table.tolist()} is not bitsandbytes' {state['quant_type']} table (supported: "
            "the nf4 and fp4 tables)"
        )
    g = scale_group(k)
    starts = torch.arange(n)[:, None] * k + torch.arange(0, k, g)[None, :]  # [N, K / g] flat index of each run
    return codes, absmax[starts // blocksize]


def quantize_nf4(w: torch.Tensor, blocksize: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes' quantize_4bit(quant_type="nf4") of w [N, K], in float32 torch: (codes uint8 [N, K], scales
    float32 [N, K / g]). Each block of the flattened w is scaled by its absmax into [-1, 1] and takes the nearest
    table value (the table's midpoints as bucket edges)."""
    n, k = w.shape
    flat = w.reshape(-1).float()
    num_blocks = -(-flat.numel() // blocksize)
    padded = torch.nn.functional.pad(flat, (0, num_blocks * blocksize - flat.numel()))
    absmax = padded.reshape(num_blocks, blocksize).abs().amax(dim=1)  # [num_blocks]
    scaled = (padded.reshape(num_blocks, blocksize) * (1.0 / absmax.clamp(min=1e-38))[:, None]).clamp(-1, 1)
    table = codebook("nf4", w.device)
    edges = (table[:-1] + table[1:]) / 2
    codes = torch.bucketize(scaled.reshape(-1)[: flat.numel()], edges, out_int32=True).to(torch.uint8)
    g = scale_group(k)
    starts = torch.arange(n, device=w.device)[:, None] * k + torch.arange(0, k, g, device=w.device)[None, :]
    return codes.reshape(n, k), absmax[starts // blocksize]


def dequantize_4bit(codes: torch.Tensor, scales: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """codes [N, K], scales [N, K / g], table [16] (the codes' values) -> float32 [N, K]."""
    g = codes.shape[1] // scales.shape[1]
    return table[codes.long()] * scales.repeat_interleave(g, dim=1)


def regroup_4bit(
    weights: Iterable[tuple[str, torch.Tensor]], storage: torch.dtype, quant_type: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each 4-bit weight's group decoded into "<module>.bnb_codes" and ".bnb_scales"
    (rows in the weight's order: a model's rearrangement of fused q/k/v rows applies to them as to a weight); other
    tensors pass as they are. A group's tensors may come in any order (or in different files): they wait until the
    group is whole. A "<module>.weight" of the storage dtype shaped [*, 1] is held until its group completes or the
    checkpoint ends (then it is a plain weight)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        split = split_name(name)
        packed_like = tensor.dtype == storage and tensor.dim() == 2 and tensor.shape[1] == 1
        if split is None or (split[1] == "weight" and not packed_like and split[0] not in pending):
            yield name, tensor
            continue
        module, component = split
        parts = pending.setdefault(module, {})
        parts[component] = tensor
        if not {"weight", "quant_state", "absmax", "quant_map"} <= parts.keys():
            continue
        state = parse_state(module, parts["quant_state"], quant_type)
        if "nested_offset" in state and not {"nested_absmax", "nested_quant_map"} <= parts.keys():
            continue
        del pending[module]
        codes, scales = decode_4bit(module, parts, state)
        yield f"{module}.bnb_codes", codes
        yield f"{module}.bnb_scales", scales
    for module, parts in pending.items():
        if parts.keys() == {"weight"}:
            yield f"{module}.weight", parts["weight"]  # a plain weight after all
            continue
        missing = sorted({"weight", "quant_state", "absmax", "quant_map"} - parts.keys())
        raise ValueError(f"checkpoint: the 4-bit weight of {module} lacks its tensors {missing} (or nested ones)")

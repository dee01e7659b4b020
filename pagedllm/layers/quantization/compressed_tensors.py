"""compressed-tensors checkpoints (quant_method "compressed-tensors", as llm-compressor writes them) with FP8 schemes:
weights fp8 e4m3 with per-tensor or per-channel scales and activations static per tensor, dynamic per token or
dynamic per tensor, or not quantized (W8A16); or block-wise weight scales with dynamic per-group activations
(FP8_BLOCK); or weight-only int schemes, "pack-quantized" W4A16 / W8A16 (compressed_tensors_wna16.py). Other schemes
(W8A8 INT8, sparsity, a quantized KV cache) are refused when the config is read, naming the field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.layers.linear import LinearBase
from pagedllm.layers.quantization.base import LinearMethod, QuantizationConfig
from pagedllm.layers.quantization.compressed_tensors_wna16 import ct_int_method
from pagedllm.layers.quantization.fp8 import Fp8LinearMethod, check_block, layer_matches

FORMATS = ("float-quantized", "naive-quantized")  # of FP8 weights
INT_FORMAT = "pack-quantized"  # of int weights (compressed_tensors_wna16.py)


@dataclass
class Group:
    targets: list[str]
    method: Fp8LinearMethod


def _fp8_args(args: dict, where: str) -> dict:
    """Checks quantization args describe symmetric 8-bit floats; returns them."""
    if not isinstance(args, dict):
        raise ValueError(f"quantization_config {where} must be an object, got {args!r}")
    if (args.get("num_bits"), args.get("type")) != (8, "float"):
        raise ValueError(
            f"quantization_config {where}: num_bits={args.get('num_bits')!r} type={args.get('type')!r} is not "
            "supported (supported: num_bits=8 type='float', FP8 e4m3)"
        )
    if args.get("symmetric", True) is not True:
        raise ValueError(f"quantization_config {where}.symmetric=False: only symmetric FP8 is supported")
    return args


def _weight_strategy(args: dict, where: str) -> tuple[str, tuple[int, int] | None]:
    """(strategy, block shape or None) of the weights' args."""
    args = _fp8_args(args, where)
    strategy = args.get("strategy", "tensor")
    if strategy not in ("tensor", "channel", "block") or args.get("dynamic", False):
        raise ValueError(
            f"quantization_config {where}.strategy={strategy!r} dynamic={args.get('dynamic')!r} is not supported "
            "(supported: static 'tensor', 'channel' or 'block' weight scales)"
        )
    block = check_block(args.get("block_structure"), f"{where}.block_structure") if strategy == "block" else None
    return strategy, block


def _activations(args: dict | None, where: str, block: tuple[int, int] | None) -> str | None:
    if args is None:
        if block is not None:
            raise ValueError(f"quantization_config {where} is missing: block-wise weights take per-group activations")
        return None
    args = _fp8_args(args, where)
    strategy, dynamic = args.get("strategy", "tensor"), args.get("dynamic", False)
    if block is not None:
        if (strategy, dynamic, args.get("group_size")) != ("group", True, block[1]):
            raise ValueError(
                f"quantization_config {where}.strategy={strategy!r} dynamic={dynamic!r} "
                f"group_size={args.get('group_size')!r}: block-wise weights take dynamic 'group' activations of "
                f"group_size={block[1]}"
            )
        return "dynamic-group"
    scheme = {("tensor", False): "static", ("token", True): "dynamic", ("tensor", True): "dynamic-tensor"}
    if (strategy, dynamic) not in scheme:
        raise ValueError(
            f"quantization_config {where}.strategy={strategy!r} dynamic={dynamic!r} is not supported (supported: "
            "static 'tensor', dynamic 'token', dynamic 'tensor')"
        )
    return scheme[strategy, dynamic]


def _group_method(group: dict, fmt: str | None, where: str) -> LinearMethod:
    """The method of one config group: FP8 schemes, or weight-only int ones (pack-quantized)."""
    if group["weights"].get("type") == "int":
        if group.get("input_activations") is not None:
            raise ValueError(
                f"quantization_config {where}.input_activations: int weights with quantized activations (W8A8 INT8) "
                "are not supported yet (supported: int weights with unquantized activations, W4A16 / W8A16)"
            )
        if fmt != INT_FORMAT:
            raise ValueError(
                f"quantization_config {where}.format={fmt!r} is not supported for int weights "
                f"(supported: {INT_FORMAT!r})"
            )
        return ct_int_method(group["weights"], f"{where}.weights")
    if fmt not in FORMATS:
        raise ValueError(
            f"quantization_config {where}.format={fmt!r} is not supported (supported: {FORMATS} for float weights, "
            f"{INT_FORMAT!r} for int weights)"
        )
    strategy, block = _weight_strategy(group["weights"], f"{where}.weights")
    activations = _activations(group.get("input_activations"), f"{where}.input_activations", block)
    return Fp8LinearMethod(strategy, activations, serialized=True, block=block)


class CompressedTensorsConfig(QuantizationConfig):
    """Each linear layer takes the method of the first config group whose `targets` name it ("Linear": every one),
    unless `ignore` names it; a layer no group targets stays dense."""

    name = "compressed-tensors"

    def __init__(self, groups: list[Group], ignore: list[str]) -> None:
        self.groups, self.ignore = groups, ignore

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CompressedTensorsConfig:
        for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
            if config.get(key):
                raise ValueError(f"quantization_config.{key}={config[key]!r} is not supported yet")
        groups_raw = config.get("config_groups")
        if not isinstance(groups_raw, dict) or not groups_raw:
            raise ValueError(f"quantization_config.config_groups={groups_raw!r} must name at least one group")
        groups = []
        for name, group in groups_raw.items():
            where = f"config_groups.{name}"
            if group.get("output_activations") is not None:
                raise ValueError(f"quantization_config {where}.output_activations is not supported")
            if not isinstance(group.get("weights"), dict):
                raise ValueError(f"quantization_config {where}.weights is missing: the schemes quantize the weights")
            targets = list(group.get("targets") or [])
            groups.append(Group(targets, _group_method(group, group.get("format") or config.get("format"), where)))
        return cls(groups, list(config.get("ignore") or []))

    def get_linear_method(self, layer: LinearBase, prefix: str) -> LinearMethod | None:
        if self.ignore and layer_matches(prefix, self.ignore, "ignore"):
            return None
        for group in self.groups:
            named = [t for t in group.targets if t != "Linear"]
            if "Linear" in group.targets or (named and layer_matches(prefix, named, "targets")):
                return group.method
        return None

"""compressed-tensors checkpoints (quant_method "compressed-tensors", as llm-compressor writes them) with FP8 schemes:
weights fp8 e4m3 with per-tensor or per-channel scales and activations static per tensor, dynamic per token or
dynamic per tensor, or not quantized (W8A16); or block-wise weight scales with dynamic per-group activations
(FP8_BLOCK); or weight-only int schemes, "pack-quantized" W4A16 / W8A16 (compressed_tensors_wna16.py); or W8A8 INT8,
"int-quantized" (int8.py). Other schemes (sparsity, a quantized KV cache, ...) are refused when the config is read,
naming the field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.layers.linear import LinearBase
from pagedllm.layers.quantization.base import LinearMethod, QuantizationConfig
from pagedllm.layers.quantization.compressed_tensors_wna16 import ct_int_method
from pagedllm.layers.quantization.fp8 import Fp8LinearMethod, check_block, layer_matches
from pagedllm.layers.quantization.int8 import Int8LinearMethod

FORMATS = ("float-quantized", "naive-quantized")  # of FP8 weights
INT_FORMAT = "pack-quantized"  # of weight-only int weights (compressed_tensors_wna16.py)
INT8_FORMATS = ("int-quantized", "naive-quantized")  # of W8A8 INT8 (int8.py)


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
        acts = group.get("input_activations")
        if acts is not None and acts.get("type") != "int":
            raise ValueError(
                f"quantization_config {where}: int weights with {acts.get('type')} activations are not supported "
                "(supported: int weights with int8 activations, W8A8, or unquantized ones, W4A16 / W8A16)"
            )
        if acts is not None:
            return _int8_method(group, fmt, where)
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


def _int8_method(group: dict, fmt: str | None, where: str) -> Int8LinearMethod:
    """W8A8 INT8: symmetric int8 weights per channel or tensor, int8 activations dynamic per token or static."""
    if fmt not in INT8_FORMATS:
        raise ValueError(
            f"quantization_config {where}.format={fmt!r} is not supported for W8A8 INT8 (supported: {INT8_FORMATS})"
        )
    weights, acts = group["weights"], group["input_activations"]
    w_strategy = weights.get("strategy", "tensor")
    if (weights.get("num_bits"), w_strategy in ("channel", "tensor"), weights.get("symmetric", True)) != (
        8,
        True,
        True,
    ):
        raise ValueError(
            f"quantization_config {where}.weights: num_bits={weights.get('num_bits')!r} strategy={w_strategy!r} "
            f"symmetric={weights.get('symmetric')!r} is not supported with int8 activations (supported: symmetric "
            "8-bit 'channel' or 'tensor' weights; W4A16 / W8A16 take no input_activations)"
        )
    scheme = (acts.get("num_bits"), acts.get("type"), acts.get("symmetric", True), acts.get("strategy"))
    kinds = {(8, "int", True, "token"): True, (8, "int", True, "tensor"): False}  # -> dynamic
    if scheme not in kinds or acts.get("dynamic", False) != kinds[scheme]:
        raise ValueError(
            f"quantization_config {where}.input_activations: num_bits={scheme[0]!r} type={scheme[1]!r} "
            f"symmetric={scheme[2]!r} strategy={scheme[3]!r} dynamic={acts.get('dynamic')!r} is not supported "
            "(supported: symmetric int8, dynamic 'token' or static 'tensor')"
        )
    return Int8LinearMethod(w_strategy, static=not kinds[scheme])


def _check_kv_cache_scheme(scheme: dict | None) -> None:
    """A kv_cache_scheme must be FP8 with per-tensor scales (the checkpoint's `*.k_scale` / `*.v_scale`, used when
    the engine runs kv_cache_dtype='fp8')."""
    if not scheme:
        return
    fields = (scheme.get("num_bits"), scheme.get("type"), scheme.get("strategy", "tensor"))
    if fields != (8, "float", "tensor") or scheme.get("dynamic"):
        raise ValueError(
            f"quantization_config.kv_cache_scheme={scheme!r} is not supported (supported: num_bits=8 type='float' "
            "strategy='tensor', static: an FP8 KV cache with per-tensor scales)"
        )


class CompressedTensorsConfig(QuantizationConfig):
    """Each linear layer takes the method of the first config group whose `targets` name it ("Linear": every one),
    unless `ignore` names it; a layer no group targets stays dense."""

    name = "compressed-tensors"

    def __init__(self, groups: list[Group], ignore: list[str]) -> None:
        self.groups, self.ignore = groups, ignore

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CompressedTensorsConfig:
        for key in ("sparsity_config", "transform_config"):
            if config.get(key):
                raise ValueError(
                    f"compressed-tensors: quantization_config.{key}={config[key]!r} is not supported yet (supported: "
                    "dense quantized weights, with no sparsity_config or transform_config)"
                )
        _check_kv_cache_scheme(config.get("kv_cache_scheme"))
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

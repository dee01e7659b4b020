"""Weight loading shared by the model files: HF names -> parameters, with stacked (merged) projections."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from pagedllm.layers.linear import default_weight_loader

# (our parameter fragment, HF fragment, shard id) for projections merged into one matmul
STACKED_PARAMS = [
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
]


def stacked_name(name: str, stacked: list[tuple[str, str, object]]) -> tuple[str, object]:
    """(our parameter name, shard id or None) of a checkpoint name, through the first matching `stacked` entry."""
    for ours, theirs, shard_id in stacked:
        if theirs in name:
            return name.replace(theirs, ours), shard_id
    return name, None


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: list[tuple[str, str, object]] = STACKED_PARAMS,
    rename: Callable[[str], str] | None = None,
    ignore: tuple[str, ...] = ("rotary_emb.inv_freq",),
) -> set[str]:
    """Hands each (hf_name, tensor) to its parameter's `weight_loader` (which takes its slice): the name as
    `rename` makes it, a projection merged into one matmul (`stacked`) going to the merged parameter with its shard
    id. A tensor that has no parameter is skipped where its name contains one of `ignore` (buffers HF saves, heads
    the model has not), else refused. Returns the parameters loaded completely (a merged one once all shards came)."""
    params = dict(model.named_parameters())
    shards: dict[str, set] = {}
    loaded: set[str] = set()
    for hf_name, tensor in weights:
        name, shard_id = stacked_name(rename(hf_name) if rename is not None else hf_name, stacked)
        param = params.get(name)
        if param is None:
            if any(s in name for s in ignore):
                continue
            raise ValueError(f"checkpoint tensor {hf_name!r} has no matching parameter in {type(model).__name__}")
        loader = getattr(param, "weight_loader", default_weight_loader)
        if shard_id is None:
            loader(param, tensor)
            loaded.add(name)
            continue
        loader(param, tensor, shard_id)
        shards.setdefault(name, set()).add(shard_id)
        if shards[name] == {s for ours, _, s in stacked if ours in name}:
            loaded.add(name)
    return loaded


def join_prefix(prefix: str, name: str) -> str:
    """The dotted name of submodule `name` of the module named `prefix` ("" at the top)."""
    return f"{prefix}.{name}" if prefix else name


def head_dim_of(config: object) -> int:
    """config.head_dim where the config sets it, else hidden_size / num_attention_heads."""
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def sliding_window_for_layer(config: object, layer_idx: int) -> int | None:
    """The sliding-window size of one layer, or None for full attention (HF's layer_types / use_sliding_window)."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    if layer_idx < getattr(config, "max_window_layers", 0):
        return None
    return window

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


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    skip: tuple[str, ...] = (),
    rename: Callable[[str, torch.Tensor], tuple[str, torch.Tensor] | None] | None = None,
    stacked: list[tuple[str, str, object]] = STACKED_PARAMS,
) -> set[str]:
    """Copies each (hf_name, tensor) into its parameter; returns the names of the parameters loaded completely
    (a merged projection only once every one of its shards came). `rename` maps a checkpoint entry to the one to
    load (a model's own names or layouts), or None to drop it. `stacked`: the projections merged on load."""
    params = dict(model.named_parameters())
    shards: dict[str, set] = {}
    loaded: set[str] = set()
    for hf_name, tensor in weights:
        if rename is not None:
            renamed = rename(hf_name, tensor)
            if renamed is None:
                continue
            hf_name, tensor = renamed
        if any(s in hf_name for s in skip) or "rotary_emb.inv_freq" in hf_name:
            continue
        name, shard_id = hf_name, None
        for ours, theirs, sid in stacked:
            if theirs in hf_name:
                name, shard_id = hf_name.replace(theirs, ours), sid
                break
        if name not in params:
            raise ValueError(f"checkpoint tensor {hf_name!r} has no matching parameter in {type(model).__name__}")
        param = params[name]
        if shard_id is None:
            getattr(param, "weight_loader", lambda p, t: default_weight_loader(p, t))(param, tensor)
            loaded.add(name)
            continue
        param.weight_loader(param, tensor, shard_id)
        shards.setdefault(name, set()).add(shard_id)
        expected = {s for ours, _, s in stacked if ours in name}
        if shards[name] == expected:
            loaded.add(name)
    return loaded


def join_prefix(prefix: str, name: str) -> str:
    """The dotted name of submodule `name` of the module named `prefix` ("" at the top)."""
    return f"{prefix}.{name}" if prefix else name


def head_dim_of(config: object) -> int:
    """config.head_dim where the config sets it, else hidden_size / num_attention_heads."""
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def norm_eps_of(config: object) -> float:
    """The norms' epsilon under any of the names the families give it."""
    for name in ("rms_norm_eps", "layer_norm_eps", "norm_epsilon", "layer_norm_epsilon"):
        eps = getattr(config, name, None)
        if eps is not None:
            return float(eps)
    return 1e-5


def num_kv_heads_of(config: object) -> int:
    """The KV heads of a config of any family (GQA's num_key_value_heads, Falcon's num_kv_heads, multi-query: 1)."""
    if getattr(config, "new_decoder_architecture", False):
        return int(config.num_kv_heads)
    if getattr(config, "multi_query", False):
        return 1
    return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)


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

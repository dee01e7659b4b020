"""Weight loading shared by the model files: HF names -> parameters, with stacked (merged) projections."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from pagedllm.layers.attention import load_kv_scale
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
    convert: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> set[str]:
    """Hands each (hf_name, tensor) to its parameter's `weight_loader` (which takes its slice): the name as
    `rename` makes it, a projection merged into one matmul (`stacked`) going to the merged parameter with its shard
    id. A tensor that has no parameter is skipped where its name contains one of `ignore` (buffers HF saves, heads
    the model has not), else refused. `convert(name, tensor)` rearranges a tensor stored in another layout (by its
    renamed name: a transposed Conv1D, q/k/v interleaved per head). Returns the parameters loaded completely (a
    merged one once all shards came)."""
    params = dict(model.named_parameters())
    ignore = (*ignore, *missing_prefixes(model))  # the parts other pipeline stages hold
    shards: dict[str, set] = {}
    loaded: set[str] = set()
    for hf_name, tensor in weights:
        name = rename(hf_name) if rename is not None else hf_name
        if convert is not None:
            tensor = convert(name, tensor)
        if name not in params and load_kv_scale(model, name, tensor):  # an FP8 KV cache's scale
            continue
        name, shard_id = stacked_name(name, stacked)
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


def load_with_language_model(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    renames: list[tuple[str, str]],
    stacked: list[tuple[str, str, object]],
    ignore: tuple[str, ...],
) -> set[str]:
    """A vision-language checkpoint's tensors: names renamed by each matching (theirs, ours) prefix in turn; those under
    `language_model.` through the language model's own loader (merged projections, tied head), the others (vision
    tower, projector) by name, unless the model was built text-only (`supports_multimodal` false)."""
    others: list[tuple[str, torch.Tensor]] = []

    def lm_weights():
        for name, tensor in weights:
            for theirs, ours in renames:
                if name.startswith(theirs):
                    name = ours + name[len(theirs) :]
            if name.startswith("language_model."):
                yield name[len("language_model.") :], tensor
            elif model.supports_multimodal:
                others.append((name, tensor))

    loaded = {f"language_model.{n}" for n in model.language_model.load_weights(lm_weights())}
    if not model.supports_multimodal:
        return loaded
    return loaded | load_weights(model, others, stacked=stacked, ignore=ignore)


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


def rank_alibi_slopes(slopes: torch.Tensor, qkv: nn.Module) -> torch.Tensor:
    """The slopes [num_heads of this rank] of the heads that tensor-parallel rank `qkv.tp_rank` holds (a
    QKVParallelLinear: each rank has qkv.num_heads consecutive heads)."""
    return slopes.narrow(0, qkv.tp_rank * qkv.num_heads, qkv.num_heads)


def regroup_per_head_qkv(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Fused q/k/v rows stored per head [(head, (q, k, v), head_dim), ...] -> [(q|k|v, head, head_dim), ...]
    (GPT-NeoX, BLOOM, Falcon, GPTBigCode without multi-query)."""
    rest = tensor.shape[1:]
    return tensor.reshape(num_heads, 3, -1, *rest).transpose(0, 1).reshape(-1, *rest)


def tied_ignore(tied: bool, head: str = "lm_head.") -> tuple[str, ...]:
    """load_weights' `ignore` of a model whose LM head may be tied to the embedding (then it has no own weight)."""
    return ("rotary_emb.inv_freq", head) if tied else ("rotary_emb.inv_freq",)


def check_learned_positions(config: object, max_position: int) -> None:
    """A model with a learned position table cannot serve positions past it: refuse a longer max_model_len."""
    table = int(config.max_position_embeddings)
    if max_position > table:
        arch = (getattr(config, "architectures", None) or [type(config).__name__])[0]
        raise ValueError(f"max_model_len={max_position} must be <= {table}: {arch} has {table} learned positions")


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


class MissingLayer(nn.Module):
    """A part of the model another pipeline stage holds: no weights here, never called; its checkpoint tensors are
    skipped (`missing_prefixes`)."""


def missing_prefixes(model: nn.Module) -> tuple[str, ...]:
    """The dotted names ("model.layers.7.") of the model's MissingLayer parts."""
    return tuple(f"{name}." for name, m in model.named_modules() if isinstance(m, MissingLayer))


def forward_with_mm_embeds(
    decoder: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, mm_embeds
) -> torch.Tensor:
    """A vision-language model's language decoder over the step's tokens, with the embeddings of image / video
    placeholder tokens replaced: mm_embeds = (rows of the flat batch [n], their embeddings [n, hidden]) or None."""
    x = decoder.embed(input_ids)  # [num_tokens, hidden]
    if mm_embeds is not None:
        x = x.index_copy(0, mm_embeds[0], mm_embeds[1].to(x.dtype))
    return decoder(input_ids, positions, inputs_embeds=x)

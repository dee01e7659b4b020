"""The transformers fallback (`model_impl="transformers"`): any HF `AutoModelForCausalLM` whose attention goes through
transformers' attention interface runs on pagedllm's paged KV cache, scheduler and sampler.

The HF model is built with `attn_implementation="pagedllm"`, an attention function registered with transformers.
Each HF attention module gets one pagedllm `Attention` layer (the runner binds its KV cache and backend as for a
native model); the registered function hands it the module's already-rotated q/k/v. pagedllm flattens the batch
into one sequence of tokens, so HF sees batch 1: q [1, num_heads, num_tokens, head_dim]. Positions go in as
`position_ids`; transformers builds no mask for an attention function it has no mask function for (the paged
backend applies causality per request). Parameter names are HF's: checkpoints load 1:1 (after transformers' own
renames of older names).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from pagedllm.layers.attention import Attention
from pagedllm.models.utils import head_dim_of, num_kv_heads_of, sliding_window_for_layer

ATTN_IMPLEMENTATION = "pagedllm"
_registered = False


# config fields of layouts the fallback cannot run: MLA's latent K/V (the cache shape differs from the attention
# modules' heads) and MoE experts (transformers fuses the per-expert checkpoint tensors at load)
_NEEDS_NATIVE = {
    "kv_lora_rank": "MLA attention",
    "num_local_experts": "mixture-of-experts layers",
    "num_experts": "mixture-of-experts layers",
    "n_routed_experts": "mixture-of-experts layers",
}


def transformers_class(architecture: str) -> type | None:
    """The transformers class of a causal-LM architecture name, or None where transformers ships none."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = {n for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for n in ((v,) if isinstance(v, str) else v)}
    if architecture not in names:
        return None
    try:
        return getattr(transformers, architecture)
    except (ImportError, AttributeError):
        return None


def check_transformers_supported(architecture: str) -> type:
    """The HF class of `architecture` for the fallback; ValueError where transformers lacks it or where its attention
    is custom code that does not go through the attention interface (pagedllm's cache could not be used)."""
    cls = transformers_class(architecture)
    if cls is None:
        raise ValueError(
            f"architecture {architecture!r}: model_impl='transformers' needs a causal LM that transformers ships "
            "(AutoModelForCausalLM); this one is not among them"
        )
    if not getattr(cls, "_supports_attention_backend", False):
        raise ValueError(
            f"architecture {architecture!r}: model_impl='transformers' needs a model whose attention goes through "
            f"transformers' attention interface; {cls.__name__} has custom attention code "
            "(_supports_attention_backend is False)"
        )
    config_cls = getattr(cls, "config_class", None)
    if config_cls is not None:
        check_layout(architecture, config_cls())
    return cls


def check_layout(architecture: str, config) -> None:
    """ValueError where a config (the class's defaults, or a checkpoint's own) has MLA or MoE fields set."""
    ffn = getattr(config, "ffn_config", None)  # DBRX keeps its experts there
    for field, what in _NEEDS_NATIVE.items():
        if getattr(config, field, None) or (field == "num_experts" and getattr(ffn, "moe_num_experts", None)):
            raise ValueError(
                f"architecture {architecture!r}: model_impl='transformers' does not run {what} ({field} in the "
                "config); use the native implementation (model_impl='auto')"
            )


def pagedllm_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over pagedllm's paged cache. query [1, num_heads, num_tokens,
    head_dim], key/value [1, num_kv_heads, num_tokens, head_dim] -> ([1, num_tokens, num_heads, head_dim], None)."""
    attn: Attention = module.pagedllm_attn
    if scaling is not None:
        attn.scale = float(scaling)
    num_heads, n, head_dim = query.shape[1:]
    q, k, v = (x[0].transpose(0, 1).reshape(n, -1) for x in (query, key, value))  # [num_tokens, heads * head_dim]
    out = attn(q, k, v)  # [num_tokens, num_heads * head_dim]
    return out.view(1, n, num_heads, head_dim), None


def register_attention() -> None:
    """Registers `pagedllm_attention` with transformers as ATTN_IMPLEMENTATION (once)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, pagedllm_attention)
    _registered = True


def _attention_modules(hf_model: nn.Module) -> list[nn.Module]:
    """The HF attention modules that call the attention interface: one per layer index (self-attention)."""
    found: dict[int, nn.Module] = {}
    for module in hf_model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and "Attention" in type(module).__name__ and idx not in found:
            found[idx] = module
    return [found[i] for i in sorted(found)]


def _make_attention(config, module: nn.Module, layer_idx: int) -> Attention:
    """pagedllm's Attention with the HF module's scaling, sliding window and soft-cap (the config's otherwise)."""
    head_dim = int(getattr(module, "head_dim", 0) or head_dim_of(config))
    num_heads = int(config.num_attention_heads)
    scale = float(getattr(module, "scaling", None) or head_dim**-0.5)
    if hasattr(module, "sliding_window"):  # set per layer by the module (None: full attention)
        window = module.sliding_window
    else:
        window = sliding_window_for_layer(config, layer_idx)
    soft_cap = getattr(module, "attn_logit_softcapping", None)
    if soft_cap is None:
        soft_cap = getattr(config, "attn_logit_softcapping", None)
    return Attention(num_heads, head_dim, scale, num_kv_heads_of(config), window or None, soft_cap)


def _build(cls: type, config) -> nn.Module:
    """The HF model on the current device and dtype, its parameters left uninitialized where transformers allows it
    (the checkpoint or the dummy loader fills them), its embedding and LM head tied as the config says."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # another transformers version: random init, slower but the same model
        from contextlib import nullcontext as no_init_weights
    with no_init_weights():
        hf = cls._from_config(config, attn_implementation=ATTN_IMPLEMENTATION, dtype=torch.get_default_dtype())
    hf.tie_weights()
    return hf


def _checkpoint_renames(hf_model: nn.Module) -> Callable[[str], str]:
    """transformers' own renames of checkpoint names (GPT-NeoX's `embed_out.` -> `lm_head.`, legacy names), so the
    fallback loads what `from_pretrained` loads. Converters that merge tensors (stacked experts) are not applied."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming

        renames = [t for t in get_model_conversion_mapping(hf_model) if type(t) is WeightRenaming]
    except (ImportError, AttributeError, TypeError):  # another transformers version: names as they are
        renames = []

    def rename(name: str) -> str:
        for t in renames:
            name = t.rename_source_key(name)[0]
        return name

    return rename


def _logits_post(config) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What HF's ForCausalLM.forward does to the LM head's output, for the config fields that say so (Cohere's
    logit_scale, Granite's logits_scaling, Gemma 2/3's final soft-cap); None: nothing."""
    scale = float(getattr(config, "logit_scale", None) or 1.0) / float(getattr(config, "logits_scaling", None) or 1.0)
    cap = getattr(config, "final_logit_softcapping", None)
    if scale == 1.0 and not cap:
        return None

    def post(logits: torch.Tensor) -> torch.Tensor:
        logits = logits * scale if scale != 1.0 else logits
        return torch.tanh(logits / cap) * cap if cap else logits

    return post


class TransformersForCausalLM(nn.Module):
    """An HF causal LM on pagedllm's runner: forward(input_ids, positions) -> hidden [num_tokens, hidden]."""

    def __init__(self, config, quant_config=None, prefix: str = "", *, max_position: int) -> None:
        super().__init__()
        architecture = (getattr(config, "architectures", None) or [type(config).__name__])[0]
        if quant_config is not None:
            raise ValueError(
                f"architecture {architecture!r}: model_impl='transformers' runs dense weights only; "
                f"quantization {type(quant_config).__name__} needs a native model class"
            )
        cls = check_transformers_supported(architecture)
        check_layout(architecture, config)
        register_attention()
        # the attention implementation is this model's, not the caller's config's; a generic config (GGUF's) becomes
        # the model's own config class, with its defaults
        config_cls = getattr(cls, "config_class", None)
        if config_cls is not None and not isinstance(config, config_cls):
            config = config_cls.from_dict(config.to_dict())
        else:
            config = copy.deepcopy(config)
        config._attn_implementation = ATTN_IMPLEMENTATION
        hf = _build(cls, config)
        self.config = config
        # HF's top-level modules become ours, so parameter names are the checkpoint's; the HF wrapper stays reachable
        # outside the module tree (its modules are the same objects)
        for name, child in hf.named_children():
            self.add_module(name, child)
        object.__setattr__(self, "hf_model", hf)
        modules = _attention_modules(hf)
        if len(modules) != int(config.num_hidden_layers):
            raise ValueError(
                f"architecture {architecture!r}: found {len(modules)} attention modules with a layer_idx for "
                f"{config.num_hidden_layers} layers; model_impl='transformers' cannot place pagedllm's KV cache"
            )
        if any(getattr(m, "is_causal", True) is False for m in modules):
            raise ValueError(
                f"architecture {architecture!r}: model_impl='transformers' runs causal (decoder) attention"
            )
        for i, module in enumerate(modules):
            module.pagedllm_attn = _make_attention(config, module, i)
        self.logits_post = _logits_post(config)
        self.rename = _checkpoint_renames(hf)
        self.ignored = [re.compile(p) for p in getattr(hf, "_keys_to_ignore_on_load_unexpected", None) or ()]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> hidden [num_tokens, hidden] (the final norm applied)."""
        out = self.hf_model.base_model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        logits = self.hf_model.get_output_embeddings()(hidden)  # [n, vocab]
        if self.logits_post is not None:
            logits = self.logits_post(logits)
        return logits.float() if upcast else logits

    def _checkpoint_name(self, name: str, targets: dict) -> str | None:
        """The module name of a checkpoint name (transformers' renames; a base-model checkpoint saved without its
        prefix); None: a tensor to skip (a tied LM head, saved rotary buffers, the model's ignored keys)."""
        name = self.rename(name)
        prefixed = f"{self.hf_model.base_model_prefix}.{name}"
        if name not in targets and prefixed in targets:
            name = prefixed
        if name in targets:
            return name
        if (
            name.endswith("rotary_emb.inv_freq")
            or name.startswith("lm_head.")
            or any(p.search(name) for p in self.ignored)
        ):
            return None
        raise ValueError(f"checkpoint weight {name!r} has no parameter in {type(self.hf_model).__name__}")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies each checkpoint tensor into the parameter or buffer of its name; returns the parameters loaded."""
        params = dict(self.named_parameters())
        targets = {**dict(self.named_buffers()), **params}
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = self._checkpoint_name(hf_name, targets)
            if name is None:
                continue
            target = targets[name]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"checkpoint weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                )
            with torch.no_grad():
                target.copy_(tensor)
            if name in params:
                loaded.add(name)
        return loaded

"""RoPE settings of a transformers config of either generation: transformers 5 keeps them in one
`rope_parameters` dict (rope_theta included), 4.x in `rope_theta` and `rope_scaling` attributes."""

from __future__ import annotations

from typing import Any

from pagedllm.layers.rope_scaling import check_rope_scaling, rope_type_of

DEFAULT_THETA = 10000.0


def rope_parameters(config: Any) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) from a transformers config of either generation (4.x or 5.x). The
    scaling dict is a copy that also carries the config's max_position_embeddings (dynamic NTK and YaRN read it)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        theta = params.get("rope_theta")
        scaling = params
    else:
        theta, scaling = None, getattr(config, "rope_scaling", None)
    if theta is None:
        theta = getattr(config, "rope_theta", None)
    theta = DEFAULT_THETA if theta is None else float(theta)
    if not isinstance(scaling, dict) or rope_type_of(scaling) == "default":
        return theta, None
    scaling = dict(scaling)
    max_pos = getattr(config, "max_position_embeddings", None)
    if max_pos is not None:
        scaling.setdefault("max_position_embeddings", max_pos)
    return theta, scaling


def _is_nested(config: Any, params: dict) -> bool:
    """transformers 5 keys rope_parameters by layer type for models whose layers differ (Gemma 3)."""
    labels = getattr(config, "layer_types", None) or ()
    return any(key in labels for key in params)


def apply_rope_overrides(config: Any, rope_scaling: Any = None, rope_theta: Any = None, prefix: str = "") -> Any:
    """Sets a user's rope_scaling (replacing the config's, as vLLM does) and rope_theta on `config`, in place.

    transformers 5: both go into `rope_parameters`, keeping the other's value (assigning `rope_scaling` there
    would drop rope_theta); then transformers re-derives what it fills in (original_max_position_embeddings).
    4.x: the two attributes. ValueError (naming `prefix + field`) for a bad value."""
    scaling = check_rope_scaling(rope_scaling, f"{prefix}rope_scaling")
    if rope_theta is not None and (isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float))):
        raise ValueError(f"{prefix}rope_theta={rope_theta!r} must be a number > 0")
    if rope_theta is not None and not rope_theta > 0:
        raise ValueError(f"{prefix}rope_theta={rope_theta!r} is out of range: a number > 0")
    if scaling is None and rope_theta is None:
        return config
    params = getattr(config, "rope_parameters", None)
    if not hasattr(config, "standardize_rope_params") or not isinstance(params, dict):  # transformers 4.x
        if scaling is not None:
            config.rope_scaling = scaling
        if rope_theta is not None:
            config.rope_theta = float(rope_theta)
        return config
    if _is_nested(config, params):
        raise ValueError(
            f"{prefix}rope_scaling / rope_theta: this model's config sets rope parameters per layer type "
            f"({sorted(params)}); set them through hf_overrides={{'rope_parameters': {{...}}}}"
        )
    theta = float(rope_theta) if rope_theta is not None else rope_parameters(config)[0]
    if scaling is not None:
        keep = {k: params[k] for k in ("partial_rotary_factor", "mrope_section") if k in params}
        params = {**keep, **scaling}
    config.rope_parameters = {**params, "rope_theta": theta}
    if hasattr(config, "rope_theta"):
        config.rope_theta = theta
    config.standardize_rope_params()
    return config


# architectures whose positions are not rotary (learned tables, ALiBi, encoders' absolute positions)
NO_ROPE_ARCHITECTURES = frozenset(
    {
        "GPT2LMHeadModel",
        "GPTBigCodeForCausalLM",
        "OPTForCausalLM",
        "BloomForCausalLM",
        "MPTForCausalLM",
        "MptForCausalLM",
        "BertModel",
        "BertForSequenceClassification",
        "RobertaModel",
        "RobertaForSequenceClassification",
        "XLMRobertaModel",
        "XLMRobertaForSequenceClassification",
    }
)


def uses_rope(config: Any) -> bool:
    """Whether the model rotates q/k by position (False: learned positions or ALiBi, where rope settings mean
    nothing)."""
    arch = (getattr(config, "architectures", None) or [""])[0]
    return arch not in NO_ROPE_ARCHITECTURES and not getattr(config, "alibi", False)


def check_rope_keywords(config: Any, rope_scaling: Any, rope_theta: Any) -> None:
    """rope_scaling / rope_theta given for a model without rotary positions: an error, not a silent no-op."""
    if (rope_scaling is not None or rope_theta is not None) and not uses_rope(config):
        arch = (getattr(config, "architectures", None) or [type(config).__name__])[0]
        raise ValueError(f"rope_scaling / rope_theta: {arch} does not use rotary position embeddings")


def rope_max_len(config: Any, derived_len: int) -> int:
    """vLLM's longest max_model_len under rope scaling: the derived length times the factor (YaRN: its
    original_max_position_embeddings times the factor); llama3 and longrope (whose max_position_embeddings
    already counts it) and Gemma 3 keep the derived length."""
    if not uses_rope(config):
        return derived_len
    _, scaling = rope_parameters(config)
    kind = rope_type_of(scaling)
    if scaling is None or kind in ("longrope", "llama3") or "gemma3" in str(getattr(config, "model_type", "")):
        return derived_len
    factor = scaling.get("factor")
    if not isinstance(factor, (int, float)) or factor <= 0:
        return derived_len
    if kind == "yarn":
        derived_len = scaling.get("original_max_position_embeddings") or derived_len
    return int(derived_len * factor)

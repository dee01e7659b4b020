"""The user's speculative-decoding options, as vLLM spells them: `speculative_config={"method": "ngram",
"num_speculative_tokens": K, "prompt_lookup_max": M, "prompt_lookup_min": m}` or `{"method": "draft_model",
"model": PATH, "num_speculative_tokens": K}` or `{"method": "eagle" | "eagle3", "model": PATH,
"num_speculative_tokens": K}` (an EAGLE head: a draft layer fed by the target's hidden states; a model given without
a method is an EAGLE head by its name, as vLLM detects it), or the older keywords `speculative_model="[ngram]"` (or a
draft model's / EAGLE head's path), `num_speculative_tokens`, `ngram_prompt_lookup_max`, `ngram_prompt_lookup_min`.

Drafts are turned off per step and row by spec_decode/policy.py (disable_by_batch_size, poor acceptance)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

METHODS = ("ngram", "draft_model", "eagle", "eagle3")
MODEL_METHODS = ("draft_model", "eagle", "eagle3")  # a model of their own, which runs where the target runs
# vLLM's other methods: named so that asking for one says it is not built, rather than that it is unknown
NOT_BUILT = ("medusa", "mlp_speculator", "deepseek_mtp", "mtp", "suffix")


@dataclass
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int | None = None  # K: drafts proposed per request and step
    prompt_lookup_max: int | None = None  # longest n-gram matched (default: prompt_lookup_min, else 5)
    prompt_lookup_min: int | None = None  # shortest n-gram matched (default: prompt_lookup_max, else 1)
    # no drafts in a step where more requests than this decode (None: always drafts); at large batches the step is
    # compute bound and the rejected drafts' work costs more than the accepted ones save
    disable_by_batch_size: int | None = None
    max_model_len: int | None = None  # no drafts for a request whose tokens and drafts would pass this length
    model: str | None = None  # the draft model or EAGLE head (methods in MODEL_METHODS): a local folder or hub name
    # ranks the draft model is split over: 1 only (the driver runs it whole; spec_decode/shared_drafts.py)
    draft_tensor_parallel_size: int | None = None
    # the draft's resolved ModelConfig, built with the target's (EngineArgs); not a user field
    draft_model_config: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.method in NOT_BUILT:
            raise ValueError(
                f"speculative_config method={self.method!r} is not implemented yet; supported methods: {METHODS}"
            )
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method={self.method!r} is not a method; supported: {METHODS}")
        if self.num_speculative_tokens is None:
            raise ValueError("speculative_config needs num_speculative_tokens (an integer >= 1)")
        _positive("num_speculative_tokens", self.num_speculative_tokens)
        if self.method in MODEL_METHODS and not (isinstance(self.model, str) and self.model):
            raise ValueError(
                f"speculative_config method={self.method!r} needs model (the draft's path), got {self.model!r}"
            )
        if self.method == "ngram" and self.model not in (None, "ngram", "[ngram]"):
            raise ValueError(f"speculative_config method='ngram' takes no model, got model={self.model!r}")
        if self.prompt_lookup_max is None and self.prompt_lookup_min is None:
            self.prompt_lookup_max, self.prompt_lookup_min = 5, 1
        elif self.prompt_lookup_max is None:
            _positive("prompt_lookup_min", self.prompt_lookup_min)
            self.prompt_lookup_max = self.prompt_lookup_min
        elif self.prompt_lookup_min is None:
            _positive("prompt_lookup_max", self.prompt_lookup_max)
            self.prompt_lookup_min = self.prompt_lookup_max
        _positive("prompt_lookup_min", self.prompt_lookup_min)
        _positive("prompt_lookup_max", self.prompt_lookup_max)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config prompt_lookup_min={self.prompt_lookup_min} must be <= "
                f"prompt_lookup_max={self.prompt_lookup_max}"
            )
        if self.disable_by_batch_size is not None:
            _positive("disable_by_batch_size", self.disable_by_batch_size)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.draft_tensor_parallel_size not in (None, 1):
            raise ValueError(
                f"speculative_config draft_tensor_parallel_size={self.draft_tensor_parallel_size!r}: the draft model "
                "runs whole on the first rank (allowed: 1), its drafts shared with the other ranks"
            )
        if self.draft_tensor_parallel_size is not None and self.method != "draft_model":
            raise ValueError(
                f"speculative_config draft_tensor_parallel_size applies to method='draft_model', not {self.method!r}"
            )

    @classmethod
    def from_user(
        cls,
        speculative_config: Any = None,
        speculative_model: str | None = None,
        num_speculative_tokens: int | None = None,
        ngram_prompt_lookup_max: int | None = None,
        ngram_prompt_lookup_min: int | None = None,
        speculative_disable_by_batch_size: int | None = None,
        speculative_max_model_len: int | None = None,
    ) -> SpeculativeConfig | None:
        """The config from LLM's arguments (None: no speculative decoding). The dict form and the older keywords
        are not mixed."""
        legacy = {
            "speculative_model": speculative_model,
            "num_speculative_tokens": num_speculative_tokens,
            "ngram_prompt_lookup_max": ngram_prompt_lookup_max,
            "ngram_prompt_lookup_min": ngram_prompt_lookup_min,
            "speculative_disable_by_batch_size": speculative_disable_by_batch_size,
            "speculative_max_model_len": speculative_max_model_len,
        }
        given = [k for k, v in legacy.items() if v is not None]
        if speculative_config is not None:
            if given:
                raise ValueError(f"give speculative_config or {given}, not both")
            return cls.from_dict(speculative_config)
        if not given:
            return None
        if speculative_model is None:
            raise ValueError(f"{given} need speculative_model='[ngram]' (or use speculative_config)")
        if speculative_model != "[ngram]":  # a draft model's path
            ngram_keys = [k for k in given if k.startswith("ngram_")]
            if ngram_keys:
                raise ValueError(f"{ngram_keys} are options of speculative_model='[ngram]', not of a draft model")
            return cls(
                method_of_model(speculative_model),
                num_speculative_tokens,
                disable_by_batch_size=speculative_disable_by_batch_size,
                max_model_len=speculative_max_model_len,
                model=speculative_model,
            )
        return cls(
            "ngram",
            num_speculative_tokens,
            ngram_prompt_lookup_max,
            ngram_prompt_lookup_min,
            disable_by_batch_size=speculative_disable_by_batch_size,
            max_model_len=speculative_max_model_len,
        )

    @classmethod
    def from_dict(cls, value: Any) -> SpeculativeConfig:
        if isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config={value!r} must be a dict, e.g. {{'method': 'ngram', ...}}")
        value = dict(value)
        if "model" in value and "method" not in value:  # vLLM's older spelling: {"model": "[ngram]"} / a model
            model = value.pop("model")
            value["method"] = "ngram" if model in ("ngram", "[ngram]") else method_of_model(model)
            if value["method"] != "ngram":
                value["model"] = model
        names = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; allowed: {sorted(names)}")
        method = value.get("method", "ngram")
        if not isinstance(method, str):
            raise ValueError(f"speculative_config method={method!r} must be a string, e.g. 'ngram'")
        return cls(**value)


def method_of_model(model: str) -> str:
    """The method of a model given without one, by its name as vLLM detects it: "eagle3" in the name is an EAGLE-3
    head (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B), "eagle-" an EAGLE head (yuhuili/EAGLE-LLaMA3-Instruct-8B),
    anything else a draft model."""
    name = str(model).lower()
    return "eagle" if "eagle-" in name else "eagle3" if "eagle3" in name else "draft_model"


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"speculative_config {name}={value!r} must be an integer >= 1")

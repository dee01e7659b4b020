"""PoolingParams: how a pooling request (embed / classify / score / encode) shapes its output, with vLLM's names."""

from __future__ import annotations

import copy
from dataclasses import dataclass

POOLING_TASKS = ("embed", "classify", "score", "token_embed", "token_classify")

# which fields each task reads; a field set for another task is a user error (as vLLM's verify)
_TASK_FIELDS = {
    "embed": ("dimensions", "normalize"),
    "token_embed": ("dimensions", "normalize"),
    "classify": ("use_activation",),
    "score": ("use_activation",),
    "token_classify": ("use_activation",),
}


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is out of range: {allowed}")


@dataclass
class PoolingParams:
    """Per-request pooling options.

    dimensions: keep the first `dimensions` features of an embedding (Matryoshka models only), then normalize.
    normalize: L2-normalize embeddings (None: the model's default, True for sentence-transformers' Normalize).
    use_activation: the classifier's activation on its outputs (softmax over several labels, sigmoid for one,
        unless the config's problem_type / cross-encoder activation says otherwise); False: raw logits (None: True).
    truncate_prompt_tokens: keep only the last k prompt tokens (-1: max_model_len); None: too long is an error.
    """

    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    activation: bool | None = None  # older vLLM name of use_activation
    task: str | None = None  # set by the API method that runs the request

    def __post_init__(self) -> None:
        k = self.truncate_prompt_tokens
        ok = k is None or (isinstance(k, int) and not isinstance(k, bool) and (k == -1 or k >= 1))
        _check(ok, "truncate_prompt_tokens", k, "None, -1 (max_model_len) or an integer >= 1")
        d = self.dimensions
        ok = d is None or (isinstance(d, int) and not isinstance(d, bool) and d >= 1)
        _check(ok, "dimensions", d, "None or an integer >= 1")
        for name in ("normalize", "use_activation", "activation"):
            value = getattr(self, name)
            _check(value is None or isinstance(value, bool), name, value, "None, True or False")
        if self.activation is not None:
            if self.use_activation is not None and self.use_activation != self.activation:
                raise ValueError(
                    f"activation={self.activation!r} and use_activation={self.use_activation!r} disagree: "
                    "set only use_activation"
                )
            self.use_activation, self.activation = self.activation, None
        _check(self.task is None or self.task in POOLING_TASKS, "task", self.task, f"one of {POOLING_TASKS}")

    def clone(self) -> PoolingParams:
        return copy.copy(self)

    def verify(self, task: str, hidden_size: int, matryoshka: list[int] | bool) -> PoolingParams:
        """A copy for `task`, checked against the model: fields of other tasks are refused, dimensions must be a
        Matryoshka size of this model. `matryoshka`: the allowed sizes, True for any size up to hidden_size."""
        if task not in POOLING_TASKS:
            raise ValueError(f"task={task!r} is out of range: one of {POOLING_TASKS}")
        if self.task is not None and self.task != task:
            raise ValueError(f"pooling_params.task={self.task!r} does not match the call's task {task!r}")
        for name in ("dimensions", "normalize", "use_activation"):
            if getattr(self, name) is not None and name not in _TASK_FIELDS[task]:
                allowed = ", ".join(_TASK_FIELDS[task])
                raise ValueError(f"{name}={getattr(self, name)!r} does not apply to task {task!r} (it takes {allowed})")
        d = self.dimensions
        if d is not None:
            if not matryoshka:
                raise ValueError(
                    f"dimensions={d}: this model does not support Matryoshka truncation; allowed: None "
                    "(models that do set `is_matryoshka` or `matryoshka_dimensions` in config.json)"
                )
            if isinstance(matryoshka, list):
                _check(d in matryoshka, "dimensions", d, f"one of the model's Matryoshka sizes {matryoshka}")
            _check(d <= hidden_size, "dimensions", d, f"[1, {hidden_size}] (the model's embedding size)")
        params = self.clone()
        params.task = task
        return params

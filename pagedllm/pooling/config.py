"""Which runner a model gets (generate or pooling), its pooling tasks, and how it pools.

The rules follow vLLM: `task` (older name) or `runner` + `convert` (newer names) pick the runner; an encoder
architecture or a decoder with a classification head (`*ForSequenceClassification`) pools by itself, a decoder
(`*ForCausalLM`) is turned into an embedder with `task="embed"` / `convert="embed"`. A sentence-transformers folder
(modules.json, 1_Pooling/config.json, sentence_bert_config.json) sets the pooling method, normalization and the
longest input; `pooler_config` overrides both.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

TASKS = ("auto", "generate", "embed", "embedding", "classify", "score")
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
POOLING_TYPES = ("MEAN", "CLS", "LAST", "MAX")

# architectures with their own pooling: encoders (CLS by default) and decoders shipped without an LM head (LAST)
_ROBERTA = (
    "RobertaModel",
    "RobertaForSequenceClassification",
    "XLMRobertaModel",
    "XLMRobertaForSequenceClassification",
    "RobertaForTokenClassification",
    "XLMRobertaForTokenClassification",
)
_ENCODER_EMBEDDERS = ("BertModel", "RobertaModel", "XLMRobertaModel")
_DECODER_EMBEDDERS = ("LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model")
_EMBEDDERS = _ENCODER_EMBEDDERS + _DECODER_EMBEDDERS
_ENCODER_CLASSIFIERS = (
    "BertForSequenceClassification",
    "RobertaForSequenceClassification",
    "XLMRobertaForSequenceClassification",
)
# decoders with HF's `score` head over the last token (models/decoder_classifier.py)
_DECODER_CLASSIFIERS = tuple(
    f"{family}ForSequenceClassification"
    for family in ("Llama", "Mistral", "Qwen2", "Qwen3", "Gemma", "Phi3", "Starcoder2")
)
_CLASSIFIERS = _ENCODER_CLASSIFIERS + _DECODER_CLASSIFIERS
# encoders with one label row per token (NER), through the token_classify task
_TOKEN_CLASSIFIERS = ("BertForTokenClassification", "RobertaForTokenClassification", "XLMRobertaForTokenClassification")
# sentence-transformers' pooling modes -> our pooling types
_ST_MODES = {
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_max_tokens": "MAX",
}
_ST_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass
class PoolerConfig:
    """vLLM's PoolerConfig: overrides the pooling method and the default normalization of a model."""

    pooling_type: str | None = None  # MEAN | CLS | LAST | MAX
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            kind = str(self.pooling_type).upper()
            if kind not in POOLING_TYPES:
                raise ValueError(f"pooler_config.pooling_type={self.pooling_type!r} must be one of {POOLING_TYPES}")
            self.pooling_type = kind
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config.normalize={self.normalize!r} must be None, True or False")

    @classmethod
    def from_user(cls, value: Any) -> PoolerConfig:
        if value is None:
            return cls()
        if isinstance(value, PoolerConfig):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {"pooling_type", "normalize"}
            if unknown:
                raise ValueError(f"pooler_config has unknown keys {sorted(unknown)}; known: pooling_type, normalize")
            return cls(**value)
        raise TypeError(f"pooler_config must be a dict or a PoolerConfig, got {type(value).__name__}")


@dataclass
class PoolingSpec:
    """What a pooling model does: its tasks (the first is encode()'s default), pooling method and defaults."""

    tasks: tuple[str, ...]
    pooling_type: str
    normalize: bool
    matryoshka: list[int] | bool = False  # allowed `dimensions`: a list, True for any, False for none
    # task -> the activation of its logits (layers/pooler.py's ACTIVATIONS) where use_activation is not False
    activations: dict[str, str] = field(default_factory=dict)

    @property
    def default_task(self) -> str:
        return self.tasks[0]


def _choose(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value is None:
        return "auto"
    if value not in allowed:
        raise ValueError(f"{name}={value!r} must be one of {allowed}")
    return value


def resolve_runner(architecture: str, task: Any, runner: Any, convert: Any) -> tuple[str, str | None]:
    """(runner, pooling kind) for an architecture: ("generate", None) or ("pooling", "embed" | "classify" |
    "token_classify")."""
    task = _choose("task", task, TASKS)
    runner, convert = _choose("runner", runner, RUNNERS), _choose("convert", convert, CONVERTS)
    task = "embed" if task == "embedding" else task
    native = (
        "embed" if architecture in _EMBEDDERS
        else "classify" if architecture in _CLASSIFIERS
        else "token_classify" if architecture in _TOKEN_CLASSIFIERS
        else None
    )  # fmt: skip
    if native is not None:
        return "pooling", _check_native(architecture, native, task, runner, convert)
    return _decoder_runner(architecture, task, runner, convert)


def _check_native(architecture: str, native: str, task: str, runner: str, convert: str) -> str:
    """A model with its own pooling head pools by itself: only its own task is allowed."""
    if task == "generate" or runner == "generate":
        raise ValueError(
            f"task/runner='generate': {architecture} is a pooling model (it cannot generate text); "
            f"allowed: task in {_tasks_of(native)} or runner='pooling'"
        )
    wanted = convert if convert not in ("auto", "none") else task if task not in ("auto", "score") else native
    if wanted != native:
        kind = {"embed": "an embedding", "classify": "a classification", "token_classify": "a token classification"}
        raise ValueError(f"task={wanted!r}: {architecture} is {kind[native]} model; allowed tasks: {_tasks_of(native)}")
    return native


def _decoder_runner(architecture: str, task: str, runner: str, convert: str) -> tuple[str, str | None]:
    """A decoder generates, or is turned into an embedder (last-token pooling) when pooling is asked for."""
    pooling = runner == "pooling" or task in ("embed", "classify", "score") or convert in ("embed", "classify")
    if not pooling:
        return "generate", None
    if runner == "generate" or task == "generate":
        raise ValueError(
            f"runner={runner!r}, task={task!r}, convert={convert!r} contradict each other: ask for generation "
            "(runner/task 'generate') or for pooling (runner 'pooling', task 'embed' / 'score', convert 'embed')"
        )
    if convert == "none":
        raise ValueError(
            f"convert='none': {architecture} has no pooling head of its own; allowed for it: convert='embed'"
        )
    if "classify" in (task, convert):
        raise ValueError(
            f"task='classify': {architecture} has no classification head; allowed for it: 'generate' or 'embed' "
            f"(classifiers: {', '.join(_CLASSIFIERS)})"
        )
    return "pooling", "embed"


def _tasks_of(kind: str) -> tuple[str, ...]:
    if kind == "token_classify":
        return ("token_classify",)
    return ("embed", "score", "token_embed") if kind == "embed" else ("classify", "score")


def classify_activation(hf_config: Any) -> str:
    """The activation of classify / token_classify logits, from the config's problem_type as HF's losses read it
    (vLLM's rule): regression -> identity, multi-label -> sigmoid per label, else "auto" (softmax over several
    labels, sigmoid for one)."""
    problem = getattr(hf_config, "problem_type", None)
    return {"regression": "identity", "multi_label_classification": "sigmoid"}.get(problem, "auto")


# sentence-transformers' CrossEncoder activation classes (torch.nn.modules.*) -> ours
_CE_ACTIVATIONS = {"Identity": "identity", "Sigmoid": "auto", "Softmax": "auto", "Tanh": "tanh"}


def score_activation(hf_config: Any) -> str:
    """The activation of a cross-encoder's score: sentence-transformers' activation_fn (config.sentence_transformers
    or sbert_ce_default_activation_function) where the config names one, else "auto" (as vLLM)."""
    st = getattr(hf_config, "sentence_transformers", None)
    name = st.get("activation_fn") if isinstance(st, dict) else None
    name = name or getattr(hf_config, "sbert_ce_default_activation_function", None)
    if not name:
        return "auto"
    short = str(name).rsplit(".", 1)[-1]
    if not str(name).startswith("torch.nn.modules.") or short not in _CE_ACTIVATIONS:
        raise ValueError(
            f"cross-encoder activation {name!r} is not supported; supported: torch.nn.modules classes "
            f"{sorted(_CE_ACTIVATIONS)}"
        )
    return _CE_ACTIVATIONS[short]


def read_sentence_transformers(model_path: str) -> dict | None:
    """What a model folder's sentence-transformers modules do: {'pooling_type', 'normalize'}; None when the folder
    has no modules.json."""
    modules_file = os.path.join(model_path, "modules.json")
    if not os.path.isfile(modules_file):
        return None
    with open(modules_file, encoding="utf-8") as f:
        modules = json.load(f)
    kinds = [m.get("type", "").rsplit(".", 1)[-1] for m in modules]
    unsupported = [k for k in kinds if k not in _ST_MODULES]
    if unsupported:
        raise ValueError(
            f"model {model_path!r}: sentence-transformers modules {unsupported} are not supported; "
            f"supported: {list(_ST_MODULES)}"
        )
    info: dict[str, Any] = {"normalize": "Normalize" in kinds, "pooling_type": None}
    pooling = next((m for m in modules if m.get("type", "").endswith(".Pooling")), None)
    if pooling is not None:
        with open(os.path.join(model_path, pooling.get("path", ""), "config.json"), encoding="utf-8") as f:
            info["pooling_type"] = _st_pooling_type(model_path, json.load(f))
    return info


def _st_pooling_type(model_path: str, config: dict) -> str:
    modes = [ours for key, ours in _ST_MODES.items() if config.get(key)]
    others = [k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in _ST_MODES]
    if len(modes) != 1 or others:
        raise ValueError(
            f"model {model_path!r}: sentence-transformers pooling {sorted(k for k, v in config.items() if v is True)} "
            f"is not supported; supported: exactly one of {sorted(_ST_MODES)}"
        )
    return modes[0]


def _matryoshka(hf_config: Any) -> list[int] | bool:
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        return sorted(int(d) for d in dims)
    return bool(getattr(hf_config, "is_matryoshka", False))


def pooling_spec(kind: str, architecture: str, model_path: str, hf_config: Any, user: PoolerConfig) -> PoolingSpec:
    """The pooling of a model: sentence-transformers files first, then the architecture's default (CLS for BERT
    embedders, LAST for decoders, both normalized), then the user's pooler_config on top."""
    st = read_sentence_transformers(model_path) if os.path.isdir(model_path) else None
    is_encoder = architecture in _ENCODER_EMBEDDERS + _ENCODER_CLASSIFIERS + _TOKEN_CLASSIFIERS
    pooling_type = "CLS" if is_encoder else "LAST"
    normalize = kind == "embed"
    if st is not None and kind == "embed":
        pooling_type = st["pooling_type"] or pooling_type
        normalize = st["normalize"]
    if user.pooling_type is not None:
        if kind != "embed":
            raise ValueError(
                f"pooler_config.pooling_type={user.pooling_type!r}: {architecture} pools with its own head; "
                "allowed: None"
            )
        pooling_type = user.pooling_type
    if user.normalize is not None:
        normalize = user.normalize
    activations = {}
    if kind != "embed":
        activations = {"classify": classify_activation(hf_config), "token_classify": classify_activation(hf_config)}
        activations["score"] = score_activation(hf_config)
    return PoolingSpec(
        tasks=_tasks_of(kind),
        pooling_type=pooling_type,
        normalize=normalize,
        matryoshka=_matryoshka(hf_config),
        activations=activations,
    )


def st_max_seq_length(model_path: str) -> int | None:
    """sentence_bert_config.json's max_seq_length (the longest input the model was trained for), if any."""
    file = os.path.join(model_path, "sentence_bert_config.json")
    if not os.path.isfile(file):
        return None
    with open(file, encoding="utf-8") as f:
        value = json.load(f).get("max_seq_length")
    return int(value) if value else None


def wants_pooling(task: Any, runner: Any, convert: Any) -> bool:
    """Whether the options ask for a pooling model before the model is known (the default model depends on it)."""
    return task in ("embed", "embedding", "score") or runner == "pooling" or convert == "embed"


def resolve_pooling(
    model_path: str, hf_config: Any, architecture: str, task: Any, runner: Any, convert: Any, pooler_config: Any
) -> tuple[str, PoolingSpec | None, int | None]:
    """(runner, pooling spec or None, longest input the model was trained for or None) of a model."""
    runner, kind = resolve_runner(architecture, task, runner, convert)
    if kind is None:
        return runner, None, None
    spec = pooling_spec(kind, architecture, model_path, hf_config, PoolerConfig.from_user(pooler_config))
    trained = st_max_seq_length(model_path) if os.path.isdir(model_path) else None
    if architecture in _ROBERTA:  # positions start at padding_idx + 1: the table holds that many fewer
        pad = getattr(hf_config, "pad_token_id", None)
        longest = int(hf_config.max_position_embeddings) - (1 if pad is None else int(pad)) - 1
        trained = min(trained or longest, longest)
    return runner, spec, trained

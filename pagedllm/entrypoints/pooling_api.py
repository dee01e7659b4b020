"""The pooling half of the offline API: `LLM.encode`, `embed`, `classify` and `score`, with vLLM's names.

Prompts are tokenized in one batch call, every request is checked before any runs, and the PoolingEngine runs them
in length-sorted batches. `score` pairs its inputs as vLLM does (1-to-1, 1-to-N, N-to-N): a cross-encoder reads each
pair as one input; an embedding model embeds both sides and returns their cosine similarity."""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F

from pagedllm.engine.pooling_engine import PoolingEngine
from pagedllm.lora.request import lora_list
from pagedllm.pooling.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringRequestOutput,
)
from pagedllm.pooling_params import PoolingParams


class PoolingAPI:
    """Mixed into LLM; `self.llm_engine` is a PoolingEngine when the model was loaded for pooling."""

    llm_engine: Any

    def _pooling_engine(self, method: str) -> PoolingEngine:
        engine = self.llm_engine
        if not isinstance(engine, PoolingEngine):
            arch = engine.config.model.architecture
            raise ValueError(
                f"{method}(): {arch} is loaded as a generative model (task='generate'); load it for pooling with "
                "LLM(model, task='embed') (or runner='pooling'), or use generate()"
            )
        return engine

    def _require_generate(self, method: str) -> None:
        if isinstance(self.llm_engine, PoolingEngine):
            model = self.llm_engine.config.model
            raise ValueError(
                f"{method}(): {model.architecture} is loaded as a pooling model (task={model.pooler.default_task!r}); "
                f"it supports {list(model.pooler.tasks)} through embed(), classify(), score() and encode()"
            )

    # -- public methods -------------------------------------------------------------------------------------------
    def encode(
        self,
        prompts: Any,
        pooling_params: PoolingParams | list[PoolingParams] | None = None,
        *,
        use_tqdm: bool = True,
        pooling_task: str | None = None,
        truncate_prompt_tokens: int | None = None,
        lora_request: Any = None,
    ) -> list[PoolingRequestOutput]:
        """The pooled tensor of each prompt (`.outputs.data`) for `pooling_task` (default: the model's own task;
        "token_embed" gives one vector per token, "token_classify" a token classifier's [num_tokens, num_labels])."""
        engine = self._pooling_engine("encode")
        task = pooling_task or engine.spec.default_task
        if task == "encode":  # vLLM's older name of the per-token task
            task = next((t for t in ("token_embed", "token_classify") if t in engine.spec.tasks), "token_embed")
        return self._pool(prompts, pooling_params, task, "encode", use_tqdm, truncate_prompt_tokens, lora_request)

    def reward(
        self,
        prompts: Any,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | list[PoolingParams] | None = None,
        lora_request: Any = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's reward(): the per-token scores of a token-classifying model (encode with "token_classify")."""
        return self.encode(prompts, pooling_params, use_tqdm=use_tqdm, pooling_task="token_classify",
                           truncate_prompt_tokens=truncate_prompt_tokens, lora_request=lora_request)  # fmt: skip

    def embed(
        self,
        prompts: Any,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | list[PoolingParams] | None = None,
        lora_request: Any = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`.outputs.embedding`, a list of floats), in input order."""
        outs = self._pool(prompts, pooling_params, "embed", "embed", use_tqdm, truncate_prompt_tokens, lora_request)
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def classify(
        self,
        prompts: Any,
        *,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | list[PoolingParams] | None = None,
        lora_request: Any = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities of each prompt (`.outputs.probs`), in input order."""
        outs = self._pool(
            prompts, pooling_params, "classify", "classify", use_tqdm, truncate_prompt_tokens, lora_request
        )
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def score(
        self,
        data_1: Any = None,
        data_2: Any = None,
        *,
        text_1: Any = None,
        text_2: Any = None,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
        lora_request: Any = None,
    ) -> list[ScoringRequestOutput]:
        """Scores of (data_1, data_2) pairs: one against many, or pairwise for two lists of the same length.
        A cross-encoder scores each pair itself; an embedding model gives the cosine of the two embeddings."""
        engine = self._pooling_engine("score")
        engine.check_task("score", "score")
        left, right = _score_side("data_1", data_1, text_1), _score_side("data_2", data_2, text_2)
        if len(left) != 1 and len(left) != len(right):
            raise ValueError(
                f"data_1 has {len(left)} items and data_2 has {len(right)}: allowed: 1 and N (one against each), "
                "or N and N (pairwise)"
            )
        params = _one_params(pooling_params, "score")
        if truncate_prompt_tokens is not None:
            params.truncate_prompt_tokens = _checked_truncation(truncate_prompt_tokens)
        if engine.spec.default_task == "classify":
            lefts = left * len(right) if len(left) == 1 else left
            return self._cross_encode(engine, lefts, right, params, use_tqdm, lora_request)
        params.verify("score", engine.hidden_size, engine.spec.matryoshka)  # refuses embedding-only fields
        embed_params = PoolingParams(truncate_prompt_tokens=params.truncate_prompt_tokens)
        outs = self._pool(left + right, embed_params, "embed", "score", use_tqdm, None, lora_request)
        firsts = outs[:1] * len(right) if len(left) == 1 else outs[: len(left)]  # 1 to N embeds the one text once
        return [_cosine_output(a, b) for a, b in zip(firsts, outs[len(left) :])]

    # -- shared steps ---------------------------------------------------------------------------------------------
    def _pool(
        self,
        prompts: Any,
        params: Any,
        task: str,
        method: str,
        use_tqdm: bool,
        truncate_prompt_tokens: int | None,
        lora_request: Any,
    ) -> list[PoolingRequestOutput]:
        engine = self._pooling_engine(method)
        engine.check_task(task, method)
        items = _as_list(prompts)
        if not items:
            raise ValueError("prompts is empty: give at least one prompt")
        params_list = _params_list(params, len(items), truncate_prompt_tokens)
        texts = [_prompt_text(p, i) for i, p in enumerate(items)]
        token_ids = self._token_ids(items, texts, params_list, engine)
        loras = lora_list(lora_request, len(items))
        # every request is checked before any runs
        requests = [
            engine.make_request(t, ids, p, task, lora_request=lora)
            for t, ids, p, lora in zip(texts, token_ids, params_list, loras)
        ]
        return engine.run(requests, use_tqdm)

    def _token_ids(self, items: list, texts: list, params_list: list[PoolingParams], engine: PoolingEngine) -> list:
        """Token ids of every prompt; texts are tokenized in one batch call per truncation length."""
        out: list = [None] * len(items)
        groups: dict[int | None, list[int]] = {}
        for i, text in enumerate(texts):
            if text is None:
                out[i] = _prompt_ids(items[i], i)
            else:
                groups.setdefault(engine.max_tokens(params_list[i]), []).append(i)
        if groups and engine.tokenizer is None:
            raise ValueError("text prompts need a tokenizer; with skip_tokenizer_init=True pass prompt_token_ids")
        for keep, rows in groups.items():
            for i, ids in zip(rows, _encode_batch(engine.tokenizer, [texts[i] for i in rows], keep)):
                out[i] = ids
        return out

    def _cross_encode(self, engine: PoolingEngine, left: list, right: list, params: PoolingParams, use_tqdm, lora):
        if engine.num_labels != 1:
            raise ValueError(
                f"score(): the cross-encoder has num_labels={engine.num_labels}; allowed: 1 (use classify() for more)"
            )
        tok = engine.tokenizer
        if tok is None:
            raise ValueError("score() needs a tokenizer; skip_tokenizer_init=True gives none")
        a = [_prompt_text(p, i) for i, p in enumerate(left)]
        b = [_prompt_text(p, i) for i, p in enumerate(right)]
        if any(t is None for t in a + b):
            raise ValueError("score() with a cross-encoder takes texts (str or {'prompt': str}), not token ids")
        keep = engine.max_tokens(params)
        enc = tok(a, b, truncation=keep is not None, max_length=keep, return_token_type_ids=True)
        loras = lora_list(lora, len(a))
        requests = [
            engine.make_request(None, ids, params, "score", token_type_ids=types, lora_request=r)
            for ids, types, r in zip(enc["input_ids"], enc["token_type_ids"], loras)
        ]
        return [ScoringRequestOutput.from_base(o) for o in engine.run(requests, use_tqdm)]


def _encode_batch(tok, texts: list[str], keep: int | None) -> list[list[int]]:
    if keep is None:
        return tok(texts)["input_ids"]
    return tok(texts, truncation=True, max_length=keep)["input_ids"]


def _cosine_output(a: PoolingRequestOutput, b: PoolingRequestOutput) -> ScoringRequestOutput:
    score = F.cosine_similarity(a.outputs.data, b.outputs.data, dim=0)  # [] float32
    out = PoolingRequestOutput(
        f"{a.request_id}_{b.request_id}", PoolingOutput(score.reshape(1)), a.prompt_token_ids + b.prompt_token_ids
    )
    return ScoringRequestOutput.from_base(out)


def _as_list(prompts: Any) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]  # one prompt given as token ids
        return list(prompts)
    raise TypeError(f"prompts has type {type(prompts).__name__}; expected a str, a prompt dict or a list of them")


def _score_side(name: str, data: Any, alias: Any) -> list:
    if data is not None and alias is not None:
        raise ValueError(f"{name} and its older name text_{name[-1]} are both given: give one")
    data = alias if data is None else data
    if data is None:
        raise ValueError(f"{name} is missing: give a text or a list of texts")
    items = _as_list(data)
    if not items:
        raise ValueError(f"{name} is empty: give at least one text")
    return items


def _prompt_text(prompt: Any, index: int) -> str | None:
    """The text of a prompt, or None for a prompt given as token ids."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return None
        if isinstance(prompt.get("prompt"), str):
            return prompt["prompt"]
        raise ValueError(f"prompts[{index}] must have a str 'prompt' or a list 'prompt_token_ids'")
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None
    raise TypeError(
        f"prompts[{index}] has type {type(prompt).__name__}; expected str, TextPrompt, TokensPrompt or list[int]"
    )


def _prompt_ids(prompt: Any, index: int) -> list[int]:
    ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"prompts[{index}].prompt_token_ids must be a list of ints")
    return list(ids)


def _one_params(params: Any, method: str) -> PoolingParams:
    if params is None:
        return PoolingParams()
    if not isinstance(params, PoolingParams):
        raise TypeError(f"{method}(): pooling_params must be a PoolingParams, got {type(params).__name__}")
    return params.clone()


def _params_list(params: Any, n: int, truncate_prompt_tokens: int | None) -> list[PoolingParams]:
    if params is None or isinstance(params, PoolingParams):
        one = _one_params(params, "pooling")
        items = [one] * n
    elif isinstance(params, (list, tuple)):
        if len(params) != n:
            raise ValueError(f"pooling_params has {len(params)} entries but there are {n} prompts")
        items = [_one_params(p, "pooling") for p in params]
    else:
        raise TypeError(f"pooling_params has type {type(params).__name__}; expected PoolingParams or a list of them")
    if truncate_prompt_tokens is not None:
        value = _checked_truncation(truncate_prompt_tokens)
        for p in items:
            p.truncate_prompt_tokens = value
    return items


def _checked_truncation(value: int) -> int:
    """The truncate_prompt_tokens argument of a call, checked as the PoolingParams field is."""
    return PoolingParams(truncate_prompt_tokens=value).truncate_prompt_tokens

"""PoolingEngine: checks pooling requests against the model, then runs them in batches of whole sequences.

A pooling request is one forward over its prompt: no KV cache, no sampler, no steps. Requests are sorted by length
(so a batch pads little) and packed up to the token budget (max_num_batched_tokens) and max_num_seqs."""

from __future__ import annotations

import itertools

from pagedllm.config import EngineConfig
from pagedllm.pooling.outputs import EmbeddingPoolingOutput, PoolingOutput, PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.worker.executor import ranks_executor
from pagedllm.worker.pooling_runner import PoolingRequest, PoolingRunner


class PoolingEngine:
    def __init__(self, config: EngineConfig, tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.spec = config.model.pooler  # PoolingSpec: tasks, pooling type, normalization, Matryoshka sizes
        # several ranks: every rank runs each batch on its shard (the multiprocess or Ray executor); the runner here
        # is the engine's own rank's (rank 0), which reads and checks requests and adapters
        self.executor = ranks_executor(config) if config.parallel.world_size > 1 else None
        self.runner = self.executor.runner if self.executor is not None else PoolingRunner(config)
        self.hidden_size = int(config.model.hf_config.hidden_size)
        self.num_labels = getattr(self.runner.model, "num_labels", None)
        self._ids = itertools.count()

    @property
    def vllm_config(self) -> EngineConfig:
        """vLLM's name of the engine's config, as vLLM's examples read it (`.model_config.hf_config.id2label`)."""
        return self.config

    def shutdown(self) -> None:
        """Ends the other ranks' workers (several ranks)."""
        if self.executor is not None:
            self.executor.shutdown()

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_lora(self, lora_request) -> bool:
        """Reads and checks a LoRA adapter (ValueError); False if its id was known."""
        return self.runner.add_lora(lora_request)

    def check_task(self, task: str, method: str) -> None:
        if task not in self.spec.tasks:
            raise ValueError(
                f"{method}(): task {task!r} is not supported by {self.config.model.architecture} "
                f"(loaded for {self.spec.default_task!r}); allowed tasks: {list(self.spec.tasks)}"
            )

    def max_tokens(self, params: PoolingParams) -> int | None:
        """How many tokens a prompt keeps under params.truncate_prompt_tokens (None: no truncation)."""
        k, limit = params.truncate_prompt_tokens, self.config.model.max_model_len
        if k is None:
            return None
        if k > limit:
            raise ValueError(f"truncate_prompt_tokens={k} is out of range: -1 or [1, {limit}] (max_model_len={limit})")
        return limit if k == -1 else k

    def make_request(
        self,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: PoolingParams,
        task: str,
        token_type_ids: list[int] | None = None,
        lora_request=None,
    ) -> PoolingRequest:
        """Checks one request (raises ValueError) without running it. `params` may be shared between requests."""
        self.check_task(task, task)
        if task == "score" and self.spec.default_task == "embed":
            raise ValueError(
                "task 'score' of an embedding model is the cosine of two embeddings: use score(); allowed tasks for "
                "encode(): ['embed', 'token_embed']"
            )
        params = params.verify(task, self.hidden_size, self.spec.matryoshka)
        keep = self.max_tokens(params)
        if keep is not None and len(prompt_token_ids) > keep:  # token prompts; texts come truncated by the tokenizer
            prompt_token_ids = prompt_token_ids[:keep]
            token_type_ids = token_type_ids[:keep] if token_type_ids is not None else None
        if not prompt_token_ids:
            raise ValueError("prompt is empty: a prompt needs at least one token")
        vocab = self.config.model.vocab_size
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids contains {bad!r}: token ids must be integers in [0, {vocab})")
        n, limit = len(prompt_token_ids), self.config.model.max_model_len
        if n > limit:
            raise ValueError(
                f"prompt length {n} is longer than max_model_len={limit}: allowed range [1, {limit}] tokens "
                "(set truncate_prompt_tokens to cut it)"
            )
        if lora_request is not None:
            self.runner.add_lora(lora_request)
        rid = self.next_request_id()
        return PoolingRequest(rid, prompt, list(prompt_token_ids), token_type_ids, params, lora_request)

    def batches(self, reqs: list[PoolingRequest]) -> list[list[int]]:
        """Indices of `reqs` grouped into forwards: sorted by length, within the token and sequence budgets and
        max_loras distinct LoRA adapters."""
        sched = self.config.scheduler
        max_loras = self.config.lora.max_loras if self.config.lora is not None else None
        loras: set[int] = set()
        order = sorted(range(len(reqs)), key=lambda i: len(reqs[i].prompt_token_ids))
        batches: list[list[int]] = []
        current: list[int] = []
        tokens = 0
        for i in order:
            n = len(reqs[i].prompt_token_ids)
            lora = reqs[i].lora_request.lora_int_id if reqs[i].lora_request is not None else 0
            new_lora = bool(lora) and lora not in loras and max_loras is not None and len(loras) >= max_loras
            if current and (
                len(current) >= sched.max_num_seqs or tokens + n > sched.max_num_batched_tokens or new_lora
            ):
                batches.append(current)
                current, tokens, loras = [], 0, set()
            current.append(i)
            tokens += n
            if lora:
                loras.add(lora)
        if current:
            batches.append(current)
        return batches

    def run(self, reqs: list[PoolingRequest], use_tqdm: bool = False) -> list[PoolingRequestOutput]:
        """Runs every request; results in input order."""
        results: list[PoolingRequestOutput | None] = [None] * len(reqs)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(reqs), desc="Processed prompts", dynamic_ncols=True)
        try:
            for batch in self.batches(reqs):
                part = [reqs[i] for i in batch]
                data = self.executor.pool(part) if self.executor is not None else self.runner.execute(part)
                for i, tensor in zip(batch, data):
                    r = reqs[i]
                    out = EmbeddingPoolingOutput(tensor) if r.params.task == "embed" else PoolingOutput(tensor)
                    results[i] = PoolingRequestOutput(r.request_id, out, r.prompt_token_ids, True, r.prompt)
                if bar:
                    bar.update(len(batch))
        finally:
            if bar:
                bar.close()
        return results  # type: ignore[return-value]

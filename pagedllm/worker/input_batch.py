"""The persistent batch: per-request rows of tokens, block tables and sampling parameters kept across steps."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pagedllm.kernels.sampling_inputs import is_filtered
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.scheduler_output import NewRequestData


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int) -> None:
        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int64)  # [rows, max_len]
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int64)  # [rows, max_blocks]
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.num_prompt = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_tokens_stop_ids: dict[int, list[int]] = {}  # row -> EOS and stop ids banned before min_tokens
        self.seed = np.zeros(max_num_reqs, dtype=np.int64)  # the request's seed as a signed 64-bit value
        self.has_seed = np.zeros(max_num_reqs, dtype=bool)
        # the request's sampling reads its output tokens on the host (bad words, logits processors; penalties too,
        # except where the GPU kernel keeps the tokens on the device)
        self.reads_outputs = np.zeros(max_num_reqs, dtype=bool)
        self.adjusts_logits = np.zeros(max_num_reqs, dtype=bool)  # adjust_logits changes them (not the penalties)
        self.penalized = np.zeros(max_num_reqs, dtype=bool)
        self.plain = np.zeros(max_num_reqs, dtype=bool)  # greedy or a temperature alone, nothing else on its logits
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)  # top logprobs of the sampled tokens, -1: none
        self.lora_id = np.zeros(max_num_reqs, dtype=np.int64)  # the request's LoRA adapter id, 0: the base model
        self.params: dict[int, SamplingParams] = {}  # row -> the request's sampling parameters (plain data)
        self.logits_processors: dict[int, list[Callable]] = {}  # row -> the request's logits processors, if any
        self.prompt_embeds: dict[int, object] = {}  # row -> [num_prompt, hidden] CPU tensor of a prompt of embeddings
        # which admission a row holds (a row given again, even to a request with the same id, gets a new one)
        self.generation = np.zeros(max_num_reqs, dtype=np.int64)
        self._num_admitted = 0
        self.row_of: dict[str, int] = {}
        # engine-wide logits processor classes run on every row (the driver's, sample/custom_batch.py): every row
        # reads its outputs on the host, has its logits changed and never samples plainly
        self.custom_logits = False
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))

    def add(self, new: NewRequestData, logits_processors: list[Callable] | None = None) -> None:
        """A request joins; logits_processors: its callables, kept where the engine runs (not in the message)."""
        req_id, params = new.req_id, new.sampling_params
        row = self.free_rows.pop()
        self.row_of[req_id] = row
        self._num_admitted += 1
        self.generation[row] = self._num_admitted
        n = len(new.token_ids)
        self.token_ids[row, :n] = new.token_ids
        self.num_tokens[row] = n
        self.num_computed[row] = new.num_computed_tokens
        self.num_blocks[row] = 0
        self.append_blocks(row, new.block_ids)
        self.params[row] = params
        if new.prompt_embeds is not None:
            self.prompt_embeds[row] = new.prompt_embeds
        if logits_processors:
            self.logits_processors[row] = list(logits_processors)
        else:
            self.logits_processors.pop(row, None)
        self.temperature[row] = params.temperature
        self.top_k[row] = min(params.top_k_enabled, 2**31 - 1)  # above the vocabulary size: no filtering
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.num_prompt[row] = new.num_prompt_tokens
        self.min_tokens[row] = params.min_tokens
        self.min_tokens_stop_ids[row] = new.min_tokens_stop_ids
        self.has_seed[row] = params.seed is not None
        self.reads_outputs[row] = bool(params.bad_words_token_ids or logits_processors or self.custom_logits)
        # the request changes its logits before sampling (besides min_tokens, which depends on the step)
        by_params = bool(params.bad_words_token_ids or params.allowed_token_ids or params.logit_bias)
        self.adjusts_logits[row] = by_params or bool(logits_processors) or self.custom_logits
        self.penalized[row] = params.has_penalties
        # from what every rank receives (a follower gets no logits processors and no masks): sample/vocab_race.py
        self.plain[row] = not (
            by_params or new.has_logits_processors or self.custom_logits or params.has_penalties
            or params.logprobs is not None or params.structured_outputs is not None
            or is_filtered(params.top_k_enabled, params.top_p, params.min_p)
        )  # fmt: skip
        self.repetition_penalty[row] = params.repetition_penalty
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self.lora_id[row] = new.lora_request.lora_int_id if new.lora_request is not None else 0
        if params.seed is not None:  # seeds span [-2**63, 2**64): the same 64 bits as a signed value
            self.seed[row] = (params.seed + 2**63) % 2**64 - 2**63

    def remove(self, req_id: str) -> None:
        """Frees the request's row."""
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.free_rows.append(row)
            self.prompt_embeds.pop(row, None)

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = self.num_blocks[row]
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def append_token(self, row: int, token_id: int) -> None:
        self.token_ids[row, self.num_tokens[row]] = token_id
        self.num_tokens[row] += 1

    def write_drafts(self, spec: dict[str, list[int]]) -> None:
        """Drafts go after their request's known tokens, as its inputs (its num_tokens stays: the accepted ones are
        appended over them when the step commits)."""
        for req_id, drafts in spec.items():
            row = self.row_of[req_id]
            n = self.num_tokens[row]
            self.token_ids[row, n : n + len(drafts)] = drafts

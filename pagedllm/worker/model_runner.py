"""ModelRunner: applies the scheduler's delta to the persistent batch, builds one flat varlen batch over the paged
KV cache, runs the model and samples the requests that reached the end of their known tokens."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.attention import get_backend
from pagedllm.attention.common import BatchLayout, kv_cache_shape
from pagedllm.config import EngineConfig
from pagedllm.forward_context import forward_context
from pagedllm.layers.attention import Attention
from pagedllm.model_loader.loader import get_model
from pagedllm.sample.sampler import Sampler
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.sample_inputs import adjust_logits, sampled_logprobs, sampling_metadata
from pagedllm.worker.scheduler_output import ModelRunnerOutput, SchedulerOutput


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.device.device
        self.block_size = config.cache.block_size
        self.max_model_len = config.model.max_model_len
        self.model = get_model(config.model, self.device)
        self.backend = get_backend(config.device.attention_backend, self.device)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.sampler = Sampler(self.device, config.model.seed)
        max_blocks = -(-self.max_model_len // self.block_size)
        self.batch = InputBatch(config.scheduler.max_num_seqs, self.max_model_len, max_blocks)

    def kv_bytes_per_block(self) -> int:
        m = self.config.model
        per_layer = 2 * self.block_size * m.num_kv_heads * m.head_dim * m.dtype.itemsize
        return per_layer * len(self.attn_layers)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        m = self.config.model
        shape = kv_cache_shape(num_blocks, self.block_size, m.num_kv_heads, m.head_dim)
        for layer in self.attn_layers:
            # Never read before written (the backends only read slots of computed tokens), so empty is enough.
            layer.kv_cache = torch.empty(shape, dtype=m.dtype, device=self.device)
            layer.backend = self.backend

    # -- applying the scheduler's delta -------------------------------------------------------------------------
    def _update_batch(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.batch.remove(req_id, finished=True)
        for req_id in so.preempted_req_ids:
            self.batch.remove(req_id, finished=False)
        for new in so.new_reqs:
            self.batch.remove(new.req_id, finished=False)  # a resumed request re-enters with all its blocks
            self.batch.add(new, self.device)
        for cached in so.cached_reqs:
            row = self.batch.row_of[cached.req_id]
            self.batch.append_blocks(row, cached.new_block_ids)
            self.batch.num_computed[row] = cached.num_computed_tokens

    # -- building the flat batch --------------------------------------------------------------------------------
    def _prepare_inputs(self, so: SchedulerOutput):
        b = self.batch
        rows = np.array([b.row_of[r] for r in so.num_scheduled_tokens], dtype=np.int64)  # [num_reqs]
        num_sched = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=len(rows))
        cu = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(num_sched, out=cu[1:])
        total = int(cu[-1])
        req_idx = np.repeat(np.arange(len(rows)), num_sched)  # [num_tokens] request of each token
        computed = b.num_computed[rows]
        positions = computed[req_idx] + np.arange(total) - cu[req_idx]  # [num_tokens]
        token_rows = rows[req_idx]
        input_ids = b.token_ids[token_rows, positions]
        slots = b.block_table[token_rows, positions // self.block_size] * self.block_size
        slots += positions % self.block_size
        seq_lens = computed + num_sched
        sample_mask = seq_lens == b.num_tokens[rows]  # reached the end of the known tokens: sample one
        layout = BatchLayout(
            cu, seq_lens, b.block_table[rows], torch.from_numpy(slots).to(self.device), self.block_size, self.device
        )
        return (
            torch.from_numpy(input_ids).to(self.device),
            torch.from_numpy(positions).to(self.device),
            layout,
            rows,
            sample_mask,
        )

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_batch(so)
        if not so.num_scheduled_tokens:
            return ModelRunnerOutput({})
        input_ids, positions, layout, rows, sample_mask = self._prepare_inputs(so)
        meta = self.backend.build_metadata(layout)
        with forward_context(meta):
            hidden = self.model(input_ids, positions)  # [num_tokens, hidden]
        req_ids = list(so.num_scheduled_tokens)
        prompt_lps = self._prompt_logprobs(hidden, layout, rows, req_ids)
        sample_idx = np.nonzero(sample_mask)[0]
        if len(sample_idx) == 0:
            return ModelRunnerOutput({}, prompt_logprobs=prompt_lps)
        logits_rows = torch.from_numpy(layout.query_start_loc[1:][sample_idx] - 1).to(self.device)
        raw_logits = self.model.compute_logits(hidden[logits_rows])  # [num_sampled, vocab] float32
        sample_rows = rows[sample_idx]
        sample_req_ids = [req_ids[i] for i in sample_idx.tolist()]
        num_top = [self.batch.params[int(r)].logprobs for r in sample_rows]
        logits = adjust_logits(
            self.batch, sample_rows, raw_logits.clone() if any(k is not None for k in num_top) else raw_logits
        )
        sampled_t = self.sampler(logits, sampling_metadata(self.batch, sample_rows, sample_req_ids, self.device))
        logprobs = sampled_logprobs(raw_logits, sampled_t, num_top)
        sampled = sampled_t.tolist()
        out, out_logprobs = {}, {}
        for j, (req_id, token) in enumerate(zip(sample_req_ids, sampled)):
            self.batch.append_token(int(sample_rows[j]), token)
            out[req_id] = token
            if logprobs[j] is not None:
                out_logprobs[req_id] = logprobs[j]
        return ModelRunnerOutput(out, out_logprobs, prompt_lps)

    def _prompt_logprobs(self, hidden: torch.Tensor, layout, rows: np.ndarray, req_ids: list[str]) -> dict:
        """For requests asking prompt_logprobs: the logprob of each prompt token this step's chunk predicts,
        as req_id -> (position of the first predicted token, [(ids, logprobs, ranks)] with the prompt token first)."""
        b = self.batch
        wanted = [i for i, r in enumerate(rows.tolist()) if b.params[r].prompt_logprobs is not None]
        hidden_rows, targets, spans = [], [], {}
        for i in wanted:
            row = int(rows[i])
            start = int(layout.seq_lens[i] - (layout.query_start_loc[i + 1] - layout.query_start_loc[i]))
            end = min(int(layout.seq_lens[i]), int(b.num_prompt[row]) - 1)  # positions predicting a prompt token
            if end <= start:
                continue
            first = int(layout.query_start_loc[i])
            hidden_rows.extend(range(first, first + end - start))
            targets.extend(b.token_ids[row, start + 1 : end + 1].tolist())
            spans[req_ids[i]] = (start + 1, end - start, b.params[row].prompt_logprobs)
        if not spans:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(hidden_rows, device=self.device)])
        entries = sampled_logprobs(
            logits,
            torch.tensor(targets, device=self.device),
            [k for _, count, k in spans.values() for _ in range(count)],
        )
        out, offset = {}, 0
        for req_id, (first_pos, count, _) in spans.items():
            out[req_id] = (first_pos, entries[offset : offset + count])
            offset += count
        return out

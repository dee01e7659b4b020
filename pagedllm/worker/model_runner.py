"""ModelRunner: applies the scheduler's delta to the persistent batch, builds one flat varlen batch over the paged
KV cache, runs the model and samples the requests that reached the end of their known tokens."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.attention import torch_backend
from pagedllm.attention.common import BatchLayout, kv_cache_shape
from pagedllm.config import EngineConfig
from pagedllm.forward_context import forward_context
from pagedllm.layers.attention import Attention
from pagedllm.model_loader.loader import get_model
from pagedllm.sample.sampler import Sampler, SamplingMetadata
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.scheduler_output import ModelRunnerOutput, SchedulerOutput


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.device.device
        self.block_size = config.cache.block_size
        self.max_model_len = config.model.max_model_len
        self.model = get_model(config.model, self.device)
        self.backend = torch_backend
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.sampler = Sampler(self.device, config.model.seed)
        max_blocks = -(-self.max_model_len // self.block_size)
        self.batch = InputBatch(config.scheduler.max_num_seqs, self.max_model_len, max_blocks)
        self.kv_caches: list[torch.Tensor] = []

    def kv_bytes_per_block(self) -> int:
        m = self.config.model
        per_layer = 2 * self.block_size * m.num_kv_heads * m.head_dim * m.dtype.itemsize
        return per_layer * len(self.attn_layers)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        m = self.config.model
        shape = kv_cache_shape(num_blocks, self.block_size, m.num_kv_heads, m.head_dim)
        self.kv_caches = []
        for layer in self.attn_layers:
            # Never read before written (the backends only read slots of computed tokens), so empty is enough.
            layer.kv_cache = torch.empty(shape, dtype=m.dtype, device=self.device)
            layer.backend = self.backend
            self.kv_caches.append(layer.kv_cache)

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

    def _sampling_metadata(self, rows: np.ndarray, req_ids: list[str]) -> SamplingMetadata:
        b = self.batch
        temp = b.temperature[rows]
        top_k, top_p, min_p = b.top_k[rows], b.top_p[rows], b.min_p[rows]
        generators = {i: b.generators[r] for i, r in enumerate(req_ids) if r in b.generators}

        def maybe(values: np.ndarray, active: bool) -> torch.Tensor | None:
            return torch.from_numpy(values).to(self.device) if active else None

        return SamplingMetadata(
            temperature=torch.from_numpy(temp).to(self.device),
            all_greedy=bool((temp < 1e-5).all()),
            top_k=maybe(top_k, bool((top_k > 0).any())),
            top_p=maybe(top_p, bool((top_p < 1.0).any())),
            min_p=maybe(min_p, bool((min_p > 0).any())),
            generators=generators,
        )

    def _ban_stop_tokens_before_min_tokens(self, logits: torch.Tensor, rows: np.ndarray) -> None:
        """EOS and stop tokens cannot be sampled while a request has fewer than min_tokens outputs."""
        b = self.batch
        short = np.nonzero(b.num_tokens[rows] - b.num_prompt[rows] < b.min_tokens[rows])[0]
        pairs = [(i, t) for i in short.tolist() for t in b.min_tokens_stop_ids[int(rows[i])]]
        if pairs:
            index = torch.tensor(pairs, device=logits.device)
            logits[index[:, 0], index[:, 1]] = float("-inf")

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
        sample_idx = np.nonzero(sample_mask)[0]
        if len(sample_idx) == 0:
            return ModelRunnerOutput({})
        logits_rows = torch.from_numpy(layout.query_start_loc[1:][sample_idx] - 1).to(self.device)
        logits = self.model.compute_logits(hidden[logits_rows])  # [num_sampled, vocab] float32
        sample_rows = rows[sample_idx]
        self._ban_stop_tokens_before_min_tokens(logits, sample_rows)
        meta = self._sampling_metadata(sample_rows, [req_ids[i] for i in sample_idx.tolist()])
        sampled = self.sampler(logits, meta).tolist()
        out = {}
        for i, token in zip(sample_idx.tolist(), sampled):
            self.batch.append_token(int(rows[i]), token)
            out[req_ids[i]] = token
        return ModelRunnerOutput(out)

"""Draft-model speculation: a small model with the target's vocabulary proposes K tokens per request by K greedy
forward passes after each target step.

The draft runs where the target runs (the model runner holds it) and has its own paged KV cache: its attention
layers get their own cache tensors with the target's block ids, so a request's block table serves both (a block's
KV bytes include the draft's layers) and a prefix-cache hit finds the draft's KV in the same blocks. Each row keeps
how many leading positions of its request hold draft KV (`valid`, reset when the row gets a new admission):

- pass 1 covers a request's positions from `valid` to its last token (normally the tokens the target just computed
  and accepted, and the token it sampled; after a prefill, a prefix hit or steps without drafts, everything the draft
  has not seen, within max_num_batched_tokens per step) and its last logits give draft 1;
- passes 2..K feed draft i - 1 at the next position (one token per row: a decode, replayed from CUDA graphs on a
  GPU) and give draft i. The drafts stay on the device until the one copy of all of them at the end.

Positions past the blocks a request holds (its last token's and the drafts', whose blocks the scheduler allocates
only when it schedules them) are written to scratch blocks after the shared ones, a few per row, and never count
as valid: the next pass 1 computes them again where the target computed them."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from pagedllm.attention.common import BatchLayout
from pagedllm.config import EngineConfig, ModelConfig
from pagedllm.device import to_device
from pagedllm.forward_context import forward_context
from pagedllm.layers.attention import Attention
from pagedllm.model_loader.loader import get_model, load_hf_config
from pagedllm.model_loader.resolve import resolve_model
from pagedllm.models.registry import resolve_model_impl
from pagedllm.spec_decode.config import SpeculativeConfig


def draft_model_config(spec: SpeculativeConfig, target: ModelConfig) -> ModelConfig:
    """The draft's ModelConfig: the target's dtype, length, seed and load format (dummy weights stay dummy), its
    own checkpoint. The draft must share the target's vocabulary (its tokens are the target's)."""
    path = resolve_model(spec.model)
    hf_config = load_hf_config(path, target.trust_remote_code, None)
    archs = getattr(hf_config, "architectures", None) or []
    if not archs:
        raise ValueError(f"speculative_config model={spec.model!r}: its config.json names no `architectures`")
    draft_vocab = getattr(hf_config, "vocab_size", None)
    if draft_vocab != target.vocab_size:
        raise ValueError(
            f"speculative_config model={spec.model!r} has vocab_size={draft_vocab}, the target model "
            f"{target.model!r} has {target.vocab_size}: a draft model must use the target's tokenizer"
        )
    return dataclasses.replace(
        target,
        model=spec.model,
        model_path=path,
        tokenizer=None,
        hf_config=hf_config,
        architecture=archs[0],
        load_format="dummy" if target.load_format == "dummy" else "auto",
        keep_q4=False,
        quantization=None,
        runner="generate",
        pooler=None,
        model_impl=resolve_model_impl(archs[0], "auto"),
    )


def make_drafter(config: EngineConfig, runner) -> DraftModelProposer | None:
    """The runner's draft model, when speculative_config asks for one."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    return DraftModelProposer(config, runner)


class DraftModelProposer:
    def __init__(self, config: EngineConfig, runner) -> None:
        spec = config.speculative_config
        self.k = spec.num_speculative_tokens
        self.runner = runner  # its persistent batch holds the requests' tokens and block tables
        self.device, self.backend = runner.device, runner.backend
        self.block_size = config.cache.block_size
        self.max_model_len = config.model.max_model_len
        self.max_num_batched_tokens = config.scheduler.max_num_batched_tokens
        self.model_config = spec.draft_model_config
        self.model = get_model(self.model_config, self.device)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        max_rows = len(runner.batch.generation)
        self.valid = np.zeros(max_rows, dtype=np.int64)  # [rows] leading positions whose draft KV is cached
        self.generation = np.full(max_rows, -1, dtype=np.int64)  # [rows] the admission `valid` counts for
        self.scratch_per_row = -(-(self.k + 1) // self.block_size) + 1
        self.num_blocks = 0  # the shared blocks; scratch blocks follow them
        self.graphs = None  # a CudaGraphRunner of the draft's decode passes (CUDA only)
        # optional (request id -> tokens so far, request id -> drafts) -> drafts, called after the passes ran:
        # benchmarks force an acceptance rate with it
        self.rewrite_drafts = None
        self.seconds = 0.0  # time spent proposing (for the benchmark's step split)

    def kv_bytes_per_block(self) -> int:
        itemsize = self.model_config.dtype.itemsize
        return sum(2 * self.block_size * a.num_kv_heads * a.head_dim * itemsize for a in self.attn_layers)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        total = num_blocks + self.scratch_per_row * len(self.valid)
        for layer in self.attn_layers:
            layer.kv_cache = self.backend.allocate_kv_cache(
                total, self.block_size, layer.num_kv_heads, layer.head_dim, self.model_config.dtype, self.device
            )
            layer.backend = self.backend
        self.num_blocks = num_blocks

    def capture_cudagraphs(self) -> float:
        """Graphs of the draft's one-token passes (the runner's rule: CUDA, Triton backend, not enforce_eager)."""
        from pagedllm.worker.cuda_graphs import CudaGraphRunner

        target = self.runner.graphs
        if target is None:
            return 0.0
        m = self.model_config
        self.graphs = CudaGraphRunner(
            self.model, self.backend, target.sizes, target.max_blocks, self.block_size, self.max_model_len,
            m.num_kv_heads, self.device,
        )  # fmt: skip
        return self.graphs.capture()

    @torch.inference_mode()
    def propose(self, token_ids: dict[str, list[int]]) -> dict[str, list[int]]:
        """request id -> its tokens so far (as in the runner's batch) => request id -> K greedy drafts."""
        start_time = time.perf_counter()
        b = self.runner.batch
        req_ids = [r for r in token_ids if r in b.row_of]
        rows = np.array([b.row_of[r] for r in req_ids], dtype=np.int64)  # [n]
        stale = self.generation[rows] != b.generation[rows]
        self.valid[rows[stale]] = 0
        self.generation[rows] = b.generation[rows]
        num_tokens = b.num_tokens[rows]  # [n]
        start = np.minimum(self.valid[rows], num_tokens - 1)  # pass 1 ends with the last token (its logits)
        need = num_tokens - start
        take = np.clip(self.max_num_batched_tokens - (np.cumsum(need) - need), 0, need)  # the step's token budget
        # rows caught up to their last token propose, with room for K drafts and the token after them
        proposing = (take == need) & (num_tokens + self.k < self.max_model_len)
        sel = np.flatnonzero(take > 0)
        table = self._block_tables(rows[sel])  # [len(sel), max_blocks]
        drafts = self._first_pass(rows[sel], start[sel], take[sel], table, proposing[sel])  # [m] on the device
        out: dict[str, list[int]] = {}
        if drafts is not None:
            keep = proposing[sel]
            drafts = self._decode_passes(drafts, num_tokens[sel][keep], table[keep])  # [m, K]
            out = dict(zip([req_ids[i] for i in sel[keep].tolist()], drafts.tolist()))
            if self.rewrite_drafts is not None:
                out = self.rewrite_drafts({r: token_ids[r] for r in out}, out)
        self.seconds += time.perf_counter() - start_time
        return out

    def _block_tables(self, rows: np.ndarray) -> np.ndarray:
        """The rows' block tables, with the scratch blocks of each (scratch_per_row, by its index here) after the
        blocks it holds. -> [len(rows), max_blocks]"""
        b = self.runner.batch
        table = b.block_table[rows].copy()
        extra = np.arange(table.shape[1])[None, :] - b.num_blocks[rows][:, None]  # [n, max_blocks] past the held
        scratch = self.num_blocks + np.arange(len(rows))[:, None] * self.scratch_per_row + extra
        use = (extra >= 0) & (extra < self.scratch_per_row)
        table[use] = scratch[use]
        return table

    def _first_pass(self, rows, start, take, table, proposing) -> torch.Tensor | None:
        """Positions [start, start + take) of each row; the rows' `valid` grow over the blocks they hold. ->
        draft 1 of the proposing rows [m] on the device (None: no row proposes)."""
        if not len(rows):
            return None
        b = self.runner.batch
        cu = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(take, out=cu[1:])
        req_idx = np.repeat(np.arange(len(rows)), take)  # [num_tokens]
        positions = start[req_idx] + np.arange(int(cu[-1])) - cu[req_idx]
        input_ids = b.token_ids[rows[req_idx], positions]
        seq_lens = start + take
        hidden = self._forward(self._to_device(input_ids), positions, cu, seq_lens, table)
        self.valid[rows] = np.minimum(seq_lens, b.num_blocks[rows] * self.block_size)
        if not proposing.any():
            return None
        last = self._to_device(cu[1:][proposing] - 1)
        return self.model.compute_logits(hidden[last]).argmax(dim=-1)

    def _decode_passes(self, first: torch.Tensor, num_tokens: np.ndarray, table: np.ndarray) -> torch.Tensor:
        """Passes 2..K: each feeds the previous draft at the next position. first [m] -> drafts [m, K]"""
        drafts = [first]
        cu = np.arange(len(num_tokens) + 1, dtype=np.int64)
        for i in range(1, self.k):
            positions = num_tokens + i - 1  # draft i - 1 sits at position num_tokens + i - 1
            hidden = self._forward(drafts[-1], positions, cu, positions + 1, table)
            drafts.append(self.model.compute_logits(hidden).argmax(dim=-1))
        return torch.stack(drafts, dim=1)

    def _forward(self, input_ids: torch.Tensor, positions, cu, seq_lens, table) -> torch.Tensor:
        """The draft over one flat batch; input_ids on the device, the rest host arrays. -> hidden [num_tokens, h]"""
        b = self.block_size
        req_idx = np.repeat(np.arange(len(seq_lens)), np.diff(cu))
        slots = table[req_idx, positions // b] * b + positions % b  # [num_tokens]
        n = len(positions)
        bs = self.graphs.padded_size(n) if self.graphs is not None and n == len(seq_lens) else None
        if bs is not None:  # one token per row: the captured decode graph
            late = (torch.arange(n, device=self.device), input_ids)
            self.graphs.load_inputs(bs, np.zeros(n, dtype=np.int64), positions, slots, seq_lens, table, late)
            return self.graphs.replay(bs, n)
        layout = BatchLayout(cu, seq_lens, table, self._to_device(slots), b, self.device)
        with forward_context(self.backend.build_metadata(layout)):
            return self.model(input_ids, self._to_device(positions))

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)

"""Draft-model speculation: a small model with the target's vocabulary proposes K tokens per request by K greedy
forward passes after each target step.

The draft runs where the target runs (the model runner holds it) and has its own paged KV cache: its attention
layers get their own cache tensors with the target's block ids, so a request's block table serves both (a block's
KV bytes include the draft's layers) and a prefix-cache hit finds the draft's KV in the same blocks. Each row keeps
how many leading positions of its request hold draft KV (`valid`, reset when the row gets a new admission):

- pass 1 covers a request's positions from `valid` to its last token and its last logits give draft 1. The draft's
  KV of its own drafts that the target accepted is kept (where it was written to blocks the request held), so in
  the steady state pass 1 covers the token the target sampled, and the last draft when all were accepted: one or two
  one-token passes. After a prefill, a prefix hit or steps without drafts it covers everything the draft has not
  seen, as one varlen batch (within max_num_batched_tokens per step);
- passes 2..K feed draft i - 1 at the next position (one token per row: a decode, replayed from CUDA graphs on a
  GPU) and give draft i. The drafts stay on the device: the proposal is a
  DeviceDrafts (spec_decode/device_drafts.py), read by the step that verifies them.

On a GPU the draft's graphs end with its LM head and argmax (each pass's output is the rows' next tokens), and
passes 2..K take their inputs in one upload and load them into the graphs' buffers on the device: the host queues
all K passes without waiting for any.

Positions past the blocks a request holds (its last token's and the drafts', whose blocks the scheduler allocates
only when it schedules them) are written to scratch blocks after the shared ones, a few per row, and never count
as valid: the next pass 1 computes them again where the target computed them."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping

import numpy as np
import torch

from pagedllm.attention.common import BatchLayout
from pagedllm.config import EngineConfig, ModelConfig
from pagedllm.device import to_device
from pagedllm.forward_context import forward_context
from pagedllm.kernels import greedy_tokens
from pagedllm.layers.attention import Attention
from pagedllm.model_loader.loader import get_model, load_hf_config
from pagedllm.model_loader.resolve import resolve_model
from pagedllm.models.registry import resolve_model_impl
from pagedllm.spec_decode.config import MODEL_METHODS, SpeculativeConfig
from pagedllm.spec_decode.device_drafts import DeviceDrafts
from pagedllm.spec_decode.shared_drafts import ReceivedDrafts, drafts_peers, share_drafts
from pagedllm.worker.cuda_graphs import CudaGraphRunner
from pagedllm.worker.verify_graphs import pick_graph


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
    """The runner's draft model or EAGLE head, when speculative_config asks for one."""
    spec = config.speculative_config
    if spec is None or spec.method not in MODEL_METHODS:
        return None
    if not runner.is_driver:  # the driver's drafts, received (spec_decode/shared_drafts.py)
        if spec.method != "draft_model":
            from pagedllm.spec_decode.eagle import follow_head

            follow_head(config, runner)
        return ReceivedDrafts(runner, spec.num_speculative_tokens)
    if spec.method != "draft_model":
        from pagedllm.spec_decode.eagle import EagleProposer

        return EagleProposer(config, runner)
    return DraftModelProposer(config, runner)


def draft_kv_bytes_per_block(proposer) -> int:
    """KV bytes of one block over a proposer's attention layers (a draft model's or an EAGLE head's)."""
    itemsize = proposer.model_config.dtype.itemsize
    return sum(2 * proposer.block_size * a.num_kv_heads * a.head_dim * itemsize for a in proposer.attn_layers)


def allocate_draft_kv_cache(proposer, num_blocks: int, num_rows: int) -> None:
    """A proposer's own KV cache: the target's num_blocks (same block ids), then scratch_per_row per batch row."""
    total = num_blocks + proposer.scratch_per_row * num_rows
    for layer in proposer.attn_layers:
        layer.kv_cache = proposer.backend.allocate_kv_cache(
            total, proposer.block_size, layer.num_kv_heads, layer.head_dim, proposer.model_config.dtype, proposer.device
        )
        layer.backend = proposer.backend
    proposer.num_blocks = num_blocks


def scratch_block_tables(batch, rows: np.ndarray, num_blocks: int, scratch_per_row: int) -> np.ndarray:
    """The rows' block tables, with the scratch blocks of each (scratch_per_row, by its index here, after the
    num_blocks shared ones) after the blocks it holds. -> [len(rows), max_blocks]"""
    table = batch.block_table[rows].copy()
    extra = np.arange(table.shape[1])[None, :] - batch.num_blocks[rows][:, None]  # [n, max_blocks] past the held
    scratch = num_blocks + np.arange(len(rows))[:, None] * scratch_per_row + extra
    use = (extra >= 0) & (extra < scratch_per_row)
    table[use] = scratch[use]
    return table


def proposer_graphs(proposer, target: CudaGraphRunner, num_kv_heads: int, extra=None):
    """A proposer's graph runners (lazy capture as the target's): one token per row (the target's decode sizes), and
    up to K + 1 per row (its verify sizes: no drafts above them). extra: the model's third input, (width, dtype).
    A proposer with a `greedy_head` gets it inside its graphs: they give each row's next token."""
    verify = getattr(proposer.runner, "verify_graphs", None)
    head = getattr(proposer, "greedy_head", None)
    runners = []
    for sizes, q_len in ((target.sizes, 1), (verify.sizes if verify is not None else target.sizes, proposer.k + 1)):
        args = (proposer.model, proposer.backend, sizes, target.max_blocks, proposer.block_size, proposer.max_model_len)
        runners.append(
            CudaGraphRunner(*args, num_kv_heads, proposer.device, None, target.lazy, q_len, extra, head=head)
        )
    return tuple(runners)


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
        self.model = get_model(self.model_config, self.device)  # on the driver alone, whole (shared_drafts.py)
        self.peers = drafts_peers(runner)  # the ranks the drafts are broadcast to (None: one rank a stage)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        max_rows = len(runner.batch.generation)
        self.valid = np.zeros(max_rows, dtype=np.int64)  # [rows] leading positions whose draft KV is cached
        self.generation = np.full(max_rows, -1, dtype=np.int64)  # [rows] the admission `valid` counts for
        # the drafts 1..K-1 fed at the last proposal: their positions start at fed_start, the first fed_len of them
        # were written to blocks the request held (their KV is reused where the target accepted them)
        self.fed = np.zeros((max_rows, max(self.k - 1, 1)), dtype=np.int64)  # [rows, K - 1]
        self.fed_start = np.zeros(max_rows, dtype=np.int64)
        self.fed_len = np.zeros(max_rows, dtype=np.int64)
        self.fed_rows: np.ndarray | None = None  # the rows of the last proposal whose fed drafts are not read yet
        self.pending: DeviceDrafts | None = None  # the last proposal (its drafts stay on the device)
        self.scratch_per_row = -(-(self.k + 1) // self.block_size) + 1
        self.num_blocks = 0  # the shared blocks; scratch blocks follow them
        self.graphs = None  # a CudaGraphRunner of the draft's decode passes (CUDA only)
        self.first_graphs = None  # and one of its first passes (at most K + 1 tokens per row)
        # optional (the proposing requests' tokens so far) -> [m, K] int64 draft tokens (-1: the draft model's), fed
        # on and proposed in place of the draft model's: benchmarks force an acceptance rate with it
        self.force_drafts = None
        self.num_first_passes = {"decode": 0, "catch_up": 0}  # how pass 1 ran (one-token passes, or a varlen batch)
        self.seconds = 0.0  # time spent proposing (for the benchmark's step split)

    def kv_bytes_per_block(self) -> int:
        return draft_kv_bytes_per_block(self)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        allocate_draft_kv_cache(self, num_blocks, len(self.valid))

    def capture_cudagraphs(self) -> float:
        """Graphs of the draft's one-token passes (the runner's rule: CUDA, Triton backend, not enforce_eager)."""
        target = self.runner.graphs
        if target is None:
            return 0.0
        self.graphs, self.first_graphs = proposer_graphs(self, target, self.model_config.num_kv_heads)
        seconds = self.graphs.capture()
        return seconds + self.first_graphs.capture(self.graphs.pool)

    @torch.inference_mode()
    def propose(self, token_ids: dict[str, list[int]]) -> Mapping[str, list[int]]:
        """request id -> its tokens so far (as in the runner's batch) => request id -> K greedy drafts (a
        DeviceDrafts: the host does not wait for them)."""
        start_time = time.perf_counter()
        b = self.runner.batch
        req_ids = [r for r in token_ids if r in b.row_of]
        rows = np.array([b.row_of[r] for r in req_ids], dtype=np.int64)  # [n]
        stale = self.generation[rows] != b.generation[rows]
        self.valid[rows[stale]], self.fed_len[rows[stale]] = 0, 0
        self.generation[rows] = b.generation[rows]
        self._take_accepted(rows)
        num_tokens = b.num_tokens[rows]  # [n]
        start = np.minimum(self.valid[rows], num_tokens - 1)  # pass 1 ends with the last token (its logits)
        need = num_tokens - start
        take = np.clip(self.max_num_batched_tokens - (np.cumsum(need) - need), 0, need)  # the step's token budget
        # rows caught up to their last token propose, with room for K drafts and the token after them
        proposing = (take == need) & (num_tokens + self.k < self.max_model_len)
        sel = np.flatnonzero(take > 0)
        keep = proposing[sel]
        ids = [req_ids[i] for i in sel[keep].tolist()]
        table = self._block_tables(rows[sel])  # [len(sel), max_blocks]
        first = self._first_pass(rows[sel], start[sel], take[sel], table, keep)  # [m] on the device
        out: dict[str, list[int]] = {}
        if first is not None:
            forced = None
            if self.force_drafts is not None:
                forced = self._to_device(self.force_drafts([token_ids[r] for r in ids]))  # [m, K], -1: the draft's
            drafts = self._decode_passes(first, num_tokens[sel][keep], table[keep], forced)  # [m, K] on the device
            self.pending = DeviceDrafts(ids, drafts)
            self._record_fed(rows[sel][keep], num_tokens[sel][keep])
            out = self.pending
        if self.peers is not None:
            share_drafts(self.peers, list(token_ids), out, self.k, self.device)
        self.seconds += time.perf_counter() - start_time
        return out

    def _take_accepted(self, rows: np.ndarray) -> None:
        """The KV the draft wrote for its own drafts (in blocks the request held) is valid up to the first that
        differs from the request's tokens now (the target accepted those before it): `valid` grows over it."""
        n = self.k - 1
        if self.fed_rows is not None:  # the last proposal's drafts, fed on: on the host by now
            self.fed[self.fed_rows] = self.pending.host()[:, :n]
            self.fed_rows = None
        if not len(rows) or n == 0:
            return
        b = self.runner.batch
        start, length = self.fed_start[rows], self.fed_len[rows]
        positions = np.minimum(start[:, None] + np.arange(n), b.token_ids.shape[1] - 1)  # [r, K - 1]
        same = (np.arange(n) < length[:, None]) & (positions < b.num_tokens[rows][:, None])
        same &= b.token_ids[rows[:, None], positions] == self.fed[rows]
        run = np.argmin(np.concatenate([same, np.zeros((len(rows), 1), dtype=bool)], axis=1), axis=1)  # [r]
        grows = self.valid[rows] >= start  # pass 1 had written the token before the drafts
        self.valid[rows] = np.where(grows, np.maximum(self.valid[rows], start + run), self.valid[rows])
        self.fed_len[rows] = 0

    def _record_fed(self, rows: np.ndarray, num_tokens: np.ndarray) -> None:
        """Drafts 1..K-1 (of self.pending) were fed at positions num_tokens.. : those in blocks the request holds
        may be reused. Their values are read at the next proposal (_take_accepted), when they are on the host."""
        n = self.k - 1
        if not len(rows) or n == 0:
            return
        held_end = self.runner.batch.num_blocks[rows] * self.block_size
        self.fed_start[rows] = num_tokens
        self.fed_rows = rows
        self.fed_len[rows] = np.clip(held_end - num_tokens, 0, n)

    def _block_tables(self, rows: np.ndarray) -> np.ndarray:
        return scratch_block_tables(self.runner.batch, rows, self.num_blocks, self.scratch_per_row)

    def record_step(self, flat, hidden: torch.Tensor, drafts: dict[str, list[int]]) -> None:
        """The target's step (its flat batch, hidden states and drafts): EAGLE heads read them; a draft model not."""

    def greedy_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, h] -> each row's greedy next token [rows] (model-dtype logits: their argmax is the float32 one's);
        inside the draft's graphs on a GPU."""
        return greedy_tokens(self.model.compute_logits(hidden, upcast=False))

    def _first_pass(self, rows, start, take, table, proposing) -> torch.Tensor | None:
        """Positions [start, start + take) of each row, as one flat varlen batch; the rows' `valid` grow over the
        blocks they hold. -> draft 1 of the proposing rows [m] on the device (None: no row proposes). In the steady
        state every row needs its last one or two tokens: a graph of K + 1 tokens per row replays it (_pass)."""
        if not len(rows):
            return None
        b = self.runner.batch
        seq_lens = start + take
        self.num_first_passes["decode" if proposing.all() and take.max() <= self.k + 1 else "catch_up"] += 1
        cu = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(take, out=cu[1:])
        req_idx = np.repeat(np.arange(len(rows)), take)  # [num_tokens]
        positions = start[req_idx] + np.arange(int(cu[-1])) - cu[req_idx]
        tokens = self._pass(b.token_ids[rows[req_idx], positions], positions, cu, seq_lens, table)  # [rows]
        self.valid[rows] = np.minimum(seq_lens, b.num_blocks[rows] * self.block_size)
        if not proposing.any():
            return None
        return tokens if proposing.all() else tokens[self._to_device(np.flatnonzero(proposing))]

    def _decode_passes(self, first, num_tokens: np.ndarray, table: np.ndarray, forced) -> torch.Tensor:
        """Passes 2..K: each feeds the previous draft at the next position. first [m] -> drafts [m, K]. forced
        [m, K] (benchmarks): where >= 0, the draft token fed on and proposed instead of the draft model's. On a GPU
        the passes' inputs go up in two copies and the graphs replay back to back: the host waits for nothing."""
        drafts = [self._forced(first, forced, 0)]
        m, n, bsz = len(num_tokens), self.k - 1, self.block_size
        positions = num_tokens + np.arange(n)[:, None]  # [K - 1, m] draft i - 1 sits at num_tokens + i - 1
        slots = table[np.arange(m), positions // bsz] * bsz + positions % bsz  # [K - 1, m]
        picked = pick_graph(self.graphs, None, np.ones(m, dtype=np.int64)) if n else None
        if picked is None:
            cu = np.arange(m + 1, dtype=np.int64)
            for i in range(n):
                token = self._eager(drafts[-1], positions[i], cu, positions[i] + 1, table, slots[i])
                drafts.append(self._forced(token, forced, i + 1))
            return torch.stack(drafts, dim=1)
        graphs, bs, _ = picked
        graphs.load_inputs(bs, np.zeros(m, dtype=np.int64), positions[0], slots[0], positions[0] + 1, table)
        steps = None
        if n > 1:  # passes 3..K: [K - 2, 3, bs] positions, slots, seq_lens (padding rows 0, -1, 0), one upload
            host = np.zeros((n - 1, 3, bs), dtype=np.int64)
            host[:, 1] = -1
            host[:, 0, :m], host[:, 1, :m], host[:, 2, :m] = positions[1:], slots[1:], positions[1:] + 1
            steps = self._to_device(host)
        out = torch.empty((m, self.k), dtype=torch.int64, device=self.device)  # [m, K]
        out[:, 0] = drafts[0]
        for i in range(n):  # (each pass's tokens copied out: the next replay rewrites the graph's output)
            graphs.load_step(out[:, i], steps[i - 1] if i else None)
            out[:, i + 1] = self._forced(graphs.replay(bs, m), forced, i + 1)
        return out

    @staticmethod
    def _forced(token: torch.Tensor, forced, i: int) -> torch.Tensor:
        return token if forced is None else torch.where(forced[:, i] >= 0, forced[:, i], token)

    def _pass(self, input_ids: np.ndarray, positions, cu, seq_lens, table) -> torch.Tensor:
        """The draft over one flat batch (host arrays) -> the greedy next token of each row's last token [rows] on
        the device. One token per row replays a decode graph, at most K + 1 a first-pass graph (the head inside
        them); anything else runs eagerly."""
        b = self.block_size
        req_idx = np.repeat(np.arange(len(seq_lens)), np.diff(cu))
        slots = table[req_idx, positions // b] * b + positions % b  # [num_tokens]
        picked = pick_graph(self.graphs, self.first_graphs, np.diff(cu))
        if picked is None:
            return self._eager(self._to_device(input_ids), positions, cu, seq_lens, table, slots)
        graphs, bs, query_lens = picked
        graphs.load_inputs(bs, input_ids, positions, slots, seq_lens, table, None, None, query_lens)
        return graphs.replay(bs, len(seq_lens))

    def _eager(self, input_ids: torch.Tensor, positions, cu, seq_lens, table, slots) -> torch.Tensor:
        """_pass without graphs, input_ids on the device."""
        layout = BatchLayout(cu, seq_lens, table, self._to_device(slots), self.block_size, self.device)
        with forward_context(self.backend.build_metadata(layout)):
            hidden = self.model(input_ids, self._to_device(positions))  # [num_tokens, h]
        return self.greedy_head(hidden if len(hidden) == len(seq_lens) else hidden[self._to_device(cu[1:] - 1)])

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)

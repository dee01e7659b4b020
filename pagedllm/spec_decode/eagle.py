"""EAGLE / EAGLE-3 speculation: a draft head (spec_decode/eagle_model.py) fed by the target's hidden states proposes
K tokens per request as a chain of K greedy steps.

The draft's row at position q takes the pair (target features at q, token q + 1) and predicts token q + 2. After
each target step the runner hands the step's flat batch and hidden states to record_step (EAGLE: the last hidden
state; EAGLE-3: three layers' hidden states, which the target's decoder copies into a buffer, through the head's fc).
A step's record is consumed once its sampled tokens are on the host (at once after a synchronous step; one step later
with asynchronous scheduling): the draft runs over each live row's positions the target computed and accepted, with
the tokens after them, writing its own paged KV cache (its attention layers' cache tensors under the target's block
ids, as the draft model's), and keeps each row's output at its last position. A row whose last position is the one
before its newest token proposes: draft 1 from that output, then drafts 2..K each fed the previous draft at the next
position with the previous step's output hidden state. Positions past the blocks a request holds go to scratch
blocks after the shared ones; the next step's record rewrites them from the target's hidden states.

A row that missed a step's record (none for the positions before its newest token) does not propose; positions the
draft never saw (a prefix-cache hit on blocks another request filled) keep what that request wrote there: drafts are
only proposals, so this changes the acceptance, never the output.

With tensor parallelism the driver alone runs the head, on whole copies of the target's embedding and LM head (their
rank shards gathered once, at start; the other ranks take part in the gathers and mirror EAGLE-3's layer hooks, so
that every rank's target runs the same collectives), and shares its drafts as a draft model does
(spec_decode/shared_drafts.py). With pipeline stages the driver is on the first stage, which holds the embedding
and the LM head and receives the final hidden states of each step from the last stage: the head runs there as on
one stage. EAGLE-3's layers may lie on any stage: each stage's decoder copies its own, and the later stages send
their columns of the buffer back with the step (distributed/pipeline.py, AuxLayers)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.common import BatchLayout
from pagedllm.config import EngineConfig, ModelConfig
from pagedllm.device import to_device
from pagedllm.distributed.pipeline import AuxLayers
from pagedllm.forward_context import forward_context
from pagedllm.layers.attention import Attention
from pagedllm.layers.linear import packed_linear
from pagedllm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.model_loader import weights as W
from pagedllm.model_loader.loader import load_hf_config
from pagedllm.model_loader.resolve import resolve_model
from pagedllm.models.llama import LlamaModel
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.device_drafts import DeviceDrafts
from pagedllm.spec_decode.draft_model import (
    allocate_draft_kv_cache,
    draft_kv_bytes_per_block,
    proposer_graphs,
    scratch_block_tables,
)
from pagedllm.spec_decode.eagle_model import EagleHead, aux_layer_ids
from pagedllm.spec_decode.shared_drafts import drafts_peers, share_drafts
from pagedllm.worker.verify_graphs import pick_graph


def eagle_model_config(spec: SpeculativeConfig, target: ModelConfig) -> ModelConfig:
    """The head's ModelConfig: its config.json, the target's dtype, length, seed and load format."""
    path = resolve_model(spec.model)
    hf_config = load_hf_config(path, target.trust_remote_code, None)
    target_hidden = target.hf_config.hidden_size
    head_hidden = getattr(hf_config, "hidden_size", None)
    if spec.method == "eagle3":
        head_hidden = getattr(hf_config, "target_hidden_size", None) or head_hidden
    if getattr(hf_config, "vocab_size", None) != target.vocab_size or head_hidden != target_hidden:
        raise ValueError(
            f"speculative_config model={spec.model!r} (method {spec.method!r}) is a head for vocab_size="
            f"{getattr(hf_config, 'vocab_size', None)} and hidden size {head_hidden}; the target model "
            f"{target.model!r} has {target.vocab_size} and {target_hidden}"
        )
    return dataclasses.replace(
        target, model=spec.model, model_path=path, tokenizer=None, hf_config=hf_config, architecture=spec.method,
        load_format="dummy" if target.load_format == "dummy" else "auto", keep_q4=False, quantization=None,
    )  # fmt: skip


def load_head(model_config: ModelConfig, target: torch.nn.Module, device: torch.device, peers=None) -> EagleHead:
    """The head with its checkpoint's weights (or dummy ones), sharing the target's embedding / LM head (whole
    copies of them where `peers`, the target's tensor-parallel group, splits them)."""
    eagle3 = model_config.architecture == "eagle3"
    if not hasattr(target, "model_attr") or not hasattr(target, "head_attr"):
        raise ValueError(f"speculative_config method {model_config.architecture!r} needs a decoder-only target model")
    target_hidden = target.config.hidden_size
    previous = torch.get_default_dtype()
    torch.set_default_dtype(model_config.dtype)
    try:
        with torch.device(device):
            head = EagleHead(model_config.hf_config, eagle3, target_hidden, model_config.max_model_len)
    finally:
        torch.set_default_dtype(previous)
    if model_config.load_format == "dummy":
        W.dummy_init(head, model_config.seed)
    else:
        path = model_config.model_path
        fmt = W.detect_format(path)
        weights = W.safetensors_weights(path) if fmt == "safetensors" else W.pt_weights(path)
        loaded = head.load_weights(weights)
        missing = {n for n, _ in head.named_parameters()} - loaded
        if missing:
            raise ValueError(f"speculative_config model={model_config.model!r} lacks weights for {sorted(missing)}")
    for module in head.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    decoder = getattr(target, target.model_attr)
    embedding, lm_head = decoder.get_submodule(target.embedding_attr), getattr(target, target.head_attr)
    if peers is not None:
        embedding, lm_head = whole_vocab_tables(target, peers, device)
    head.share(embedding, lm_head)
    return head.eval()


def whole_vocab_tables(target: torch.nn.Module, peers, device: torch.device):
    """(embedding, LM head) of one rank holding the whole vocabulary, from the target's shards gathered over `peers`
    (every rank of the group calls this, in the same order)."""
    decoder = getattr(target, target.model_attr)
    shards, head = decoder.get_submodule(target.embedding_attr), getattr(target, target.head_attr)
    hidden, dtype = shards.weight.shape[1], shards.weight.dtype
    with torch.device(device):  # (outside a build context: one rank's modules)
        embedding = VocabParallelEmbedding(shards.vocab_size, hidden)
        lm_head = ParallelLMHead(head.vocab_size, hidden)
    embedding.weight.data.copy_(_gathered(shards, peers, hidden, dtype))
    if head.tied:
        lm_head.tie(embedding)
    else:
        lm_head.weight.data.copy_(_gathered(head, peers, hidden, dtype))
    lm_head.process_weights_after_loading()
    return embedding, lm_head


def _gathered(table: VocabParallelEmbedding, peers, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """The whole [vocab, hidden] table from each rank's rows."""
    if table.weight is not None:
        rows_t = table.weight.t()
    else:  # a CPU LM head packed for oneDNN: its rows back through an identity matmul (each product x 1: exact)
        rows_t = packed_linear(torch.eye(hidden, dtype=dtype), table.cpu_weight, None)  # [hidden, rows]
    whole = peers.all_gather(rows_t.contiguous())  # [hidden, ranks * rows_per_rank]
    return whole.t()[: table.vocab_size]


def follow_head(config: EngineConfig, runner) -> None:
    """A follower rank's part of the driver's EAGLE head: the vocabulary gathers (the first stage's ranks), and
    EAGLE-3's layer hooks (every rank)."""
    spec = config.speculative_config
    if runner.stage is None or runner.stage.is_first:
        whole_vocab_tables(runner.model, drafts_peers(runner), runner.device)
    if spec.draft_model_config.architecture == "eagle3":
        hook_aux_layers(spec.draft_model_config, runner, config)


def hook_aux_layers(model_config: ModelConfig, runner, config: EngineConfig) -> None:
    """EAGLE-3 reads three of the target's layers: its decoder copies them into a buffer each forward (with pipeline
    stages, each stage its own layers; the first stage receives the others' columns: distributed/pipeline.py)."""
    target, device = runner.model, runner.device
    decoder = getattr(target, target.model_attr)
    if not isinstance(decoder, LlamaModel) or type(decoder).forward is not LlamaModel.forward:
        raise ValueError(
            f"speculative_config method 'eagle3' needs a Llama-family target; {config.model.architecture} "
            "does not expose its layers' hidden states"
        )
    ids = aux_layer_ids(model_config.hf_config, len(decoder.layers))
    rows = max(config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs)
    decoder.aux_hidden_state_layers = ids
    decoder.defer_reductions()  # the copied layers' inputs must be whole sums
    decoder.aux_hidden_states = torch.zeros(  # [max tokens, 3 * target H]
        rows, 3 * target.config.hidden_size, dtype=config.model.dtype, device=device
    )
    if runner.stage is not None:
        runner.stage.aux = AuxLayers(decoder.aux_hidden_states, ids, len(decoder.layers), runner.groups.info.pp_size)


@dataclass
class StepRecord:
    """One target step, as the draft needs it (host arrays per request of the step, features on the device)."""

    req_ids: list[str]
    rows: np.ndarray  # [n] persistent-batch rows
    generations: np.ndarray  # [n] the admission each row held
    start: np.ndarray  # [n] first position computed
    count: np.ndarray  # [n] positions computed
    cu: np.ndarray  # [n + 1] the requests' offsets in features
    waits: np.ndarray  # [n] sampled in the step: ready once its tokens are committed (num_tokens > known)
    known: np.ndarray  # [n] the row's tokens before the step's sampled ones (its inputs less its drafts)
    features: torch.Tensor  # [num_tokens, H] the head's input hidden states (after combine)


class EagleProposer:
    def __init__(self, config: EngineConfig, runner) -> None:
        spec = config.speculative_config
        self.k, self.runner = spec.num_speculative_tokens, runner
        self.device, self.backend = runner.device, runner.backend
        self.block_size, self.max_model_len = config.cache.block_size, config.model.max_model_len
        self.model_config = spec.draft_model_config
        self.peers = drafts_peers(runner)  # the ranks the drafts are broadcast to (None: one rank)
        self.model = load_head(self.model_config, runner.model, self.device, self.peers)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        if self.model.eagle3:
            hook_aux_layers(self.model_config, runner, config)
        max_rows, h = len(runner.batch.generation), self.model_config.hf_config.hidden_size
        dtype = self.model_config.dtype
        # per row: the draft's outputs at the last position it computed (for the logits, for the next step)
        self.tail_logit = torch.zeros(max_rows, h, dtype=dtype, device=self.device)  # [rows, H]
        self.tail_next = torch.zeros(max_rows, h, dtype=dtype, device=self.device)  # [rows, H]
        self.tail_pos = np.full(max_rows, -1, dtype=np.int64)  # [rows] that position
        self.tail_gen = np.full(max_rows, -1, dtype=np.int64)  # [rows] the admission it belongs to
        self.records: list[StepRecord] = []
        self.scratch_per_row = -(-(self.k + 1) // self.block_size) + 1
        self.num_blocks = 0  # the shared blocks; scratch blocks follow them
        # optional (the proposing requests' tokens so far) -> [m, K] int64 draft tokens (-1: the head's), fed on and
        # proposed in place of the head's: benchmarks force an acceptance rate with it
        self.force_drafts = None
        self.seconds = 0.0  # time spent in the head (for the benchmark's step split)
        self.graphs = self.first_graphs = None  # CudaGraphRunners of its passes (CUDA only)
        self.pending: DeviceDrafts | None = None  # the last proposal (its drafts stay on the device)

    def kv_bytes_per_block(self) -> int:
        return draft_kv_bytes_per_block(self)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        allocate_draft_kv_cache(self, num_blocks, len(self.tail_pos))

    def capture_cudagraphs(self) -> float:
        """Graphs of the head's passes (the runner's rule: CUDA, Triton backend, not enforce_eager): the chain's
        one-token steps and the record's passes of at most K + 1 tokens per row, the hidden states a static input."""
        target = self.runner.graphs
        if target is None:
            return 0.0
        extra = (self.model_config.hf_config.hidden_size, self.model_config.dtype)
        self.graphs, self.first_graphs = proposer_graphs(self, target, self.attn_layers[0].num_kv_heads, extra)
        seconds = self.graphs.capture()
        return seconds + self.first_graphs.capture(self.graphs.pool)

    @torch.inference_mode()
    def record_step(self, flat, hidden: torch.Tensor, drafts: dict[str, list[int]]) -> None:
        """The target's step: flat batch (model_runner.FlatBatch), hidden [num_tokens, H] and the drafts it verifies.
        Consumed once its tokens are on the host."""
        start_time = time.perf_counter()
        self._consume_ready()
        n = len(flat.input_ids)
        if self.model.eagle3:
            decoder = getattr(self.runner.model, self.runner.model.model_attr)
            graph = self.runner.last_graph  # a verify graph wrote its rows in its own (padded) order
            aux = decoder.aux_hidden_states
            aux = aux[:n] if graph is None or graph.q_len == 1 else aux.index_select(0, graph.dev_i64[3, :n])
            features = self.model.combine(aux)
        else:
            features = hidden[:n].clone()  # (a CUDA graph's output buffer is overwritten by the next replay)
        b, counts = self.runner.batch, np.diff(flat.query_start_loc)
        # (with asynchronous scheduling the host's num_tokens may still lack the previous step's token)
        num_drafts = np.array([len(drafts.get(r, ())) for r in flat.req_ids], dtype=np.int64)
        self.records.append(
            StepRecord(
                list(flat.req_ids), flat.rows.copy(), b.generation[flat.rows].copy(), flat.seq_lens - counts,
                counts, flat.query_start_loc.copy(), flat.sample_mask.copy(), flat.seq_lens - num_drafts, features,
            )
        )  # fmt: skip
        self.seconds += time.perf_counter() - start_time

    def _alive(self, rec: StepRecord) -> np.ndarray:
        b = self.runner.batch
        same_row = np.array([b.row_of.get(r) == row for r, row in zip(rec.req_ids, rec.rows.tolist())], dtype=bool)
        return same_row & (b.generation[rec.rows] == rec.generations)

    def _consume_ready(self) -> None:
        """The records, oldest first, whose live rows have their step's tokens on the host."""
        while self.records:
            rec = self.records[0]
            alive = self._alive(rec)
            ready = ~rec.waits | (self.runner.batch.num_tokens[rec.rows] > rec.known)
            if not (ready | ~alive).all():
                return
            self.records.pop(0)
            self._consume(rec, alive)

    def _consume(self, rec: StepRecord, alive: np.ndarray) -> None:
        """The draft over the positions of the record that the target accepted (those before each live row's
        newest token), each with the token after it; the rows' tails are its outputs at their last position."""
        b = self.runner.batch
        end = np.minimum(rec.start + rec.count, b.num_tokens[rec.rows] - 1)
        take = np.where(alive, np.clip(end - rec.start, 0, rec.count), 0)  # [n]
        sel = np.flatnonzero(take > 0)
        if not len(sel):
            return
        take, start, rows = take[sel], rec.start[sel], rec.rows[sel]
        cu = np.zeros(len(sel) + 1, dtype=np.int64)
        np.cumsum(take, out=cu[1:])
        req_idx = np.repeat(np.arange(len(sel)), take)  # [num_tokens]
        offset = np.arange(int(cu[-1])) - cu[req_idx]
        positions = start[req_idx] + offset
        input_ids = self._to_device(b.token_ids[rows[req_idx], positions + 1])
        hidden = rec.features[self._to_device(rec.cu[sel][req_idx] + offset)]  # [num_tokens, H]
        seq_lens = start + take
        logit_h, next_h = self._forward(input_ids, positions, cu, seq_lens, b.block_table[rows], hidden)
        last, rows_t = self._to_device(cu[1:] - 1), self._to_device(rows)
        self.tail_logit[rows_t] = logit_h[last]
        self.tail_next[rows_t] = next_h[last]
        self.tail_pos[rows], self.tail_gen[rows] = seq_lens - 1, rec.generations[sel]

    @torch.inference_mode()
    def propose(self, token_ids: dict[str, list[int]]) -> Mapping[str, list[int]]:
        """request id -> its tokens so far (as in the runner's batch) => request id -> K greedy drafts (a
        DeviceDrafts: the host does not wait for them)."""
        start_time = time.perf_counter()
        self._consume_ready()
        b = self.runner.batch
        req_ids = [r for r in token_ids if r in b.row_of]
        rows = np.array([b.row_of[r] for r in req_ids], dtype=np.int64)  # [n]
        num_tokens = b.num_tokens[rows]
        ok = (self.tail_pos[rows] == num_tokens - 2) & (self.tail_gen[rows] == b.generation[rows])
        ok &= num_tokens + self.k < self.max_model_len  # room for K drafts and the token after them
        keep = np.flatnonzero(ok)
        out: Mapping[str, list[int]] = {}
        if len(keep):
            ids = [req_ids[i] for i in keep.tolist()]
            forced = None
            if self.force_drafts is not None:
                forced = self._to_device(self.force_drafts([token_ids[r] for r in ids]))  # [m, K], -1: the head's
            out = self.pending = DeviceDrafts(ids, self._chain(rows[keep], num_tokens[keep], forced))
        if self.peers is not None:
            share_drafts(self.peers, list(token_ids), out, self.k, self.device)
        self.seconds += time.perf_counter() - start_time
        return out

    def _chain(self, rows: np.ndarray, num_tokens: np.ndarray, forced) -> torch.Tensor:
        """Draft 1 from the rows' tails, then drafts 2..K: draft i - 1 fed at position num_tokens + i - 3 with the
        previous output hidden state. -> [m, K] on the device"""
        rows_t = self._to_device(rows)
        logit_h, next_h = self.tail_logit[rows_t], self.tail_next[rows_t]
        token = self.model.draft_tokens(logit_h)
        drafts = [token if forced is None else torch.where(forced[:, 0] >= 0, forced[:, 0], token)]
        table = scratch_block_tables(self.runner.batch, rows, self.num_blocks, self.scratch_per_row)
        cu = np.arange(len(rows) + 1, dtype=np.int64)
        for i in range(1, self.k):
            positions = num_tokens - 2 + i
            logit_h, next_h = self._forward(drafts[-1], positions, cu, positions + 1, table, next_h)
            token = self.model.draft_tokens(logit_h)
            drafts.append(token if forced is None else torch.where(forced[:, i] >= 0, forced[:, i], token))
        return torch.stack(drafts, dim=1)

    def _forward(self, input_ids: torch.Tensor, positions, cu, seq_lens, table, hidden: torch.Tensor):
        """The head over one flat batch (input_ids and hidden on the device, the rest host arrays). -> (hidden for
        the logits, hidden for the next step), each [num_tokens, H]"""
        b = self.block_size
        req_idx = np.repeat(np.arange(len(seq_lens)), np.diff(cu))
        slots = table[req_idx, positions // b] * b + positions % b  # [num_tokens]
        n = len(positions)
        picked = pick_graph(self.graphs, self.first_graphs, np.diff(cu))
        if picked is not None:  # one token per row, or at most K + 1: a graph, the hidden states a static input
            graphs, bs, query_lens = picked
            late = (torch.arange(n, device=self.device), input_ids)  # (the inputs are on the device)
            graphs.load_inputs(
                bs, np.zeros(n, dtype=np.int64), positions, slots, seq_lens, table, late, None, query_lens
            )
            graphs.load_extra(hidden)
            return graphs.replay(bs, n)
        layout = BatchLayout(cu, seq_lens, table, self._to_device(slots), b, self.device)
        with forward_context(self.backend.build_metadata(layout)):
            return self.model(input_ids, self._to_device(positions), hidden)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)

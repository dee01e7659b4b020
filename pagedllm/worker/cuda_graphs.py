"""CUDA graphs for pure-decode steps: one graph per captured batch size, replayed over static input buffers.

A decode step of n requests is padded to the next captured size: padded rows get token 0 at position 0, cache
slot -1 (the KV-write kernel skips it) and sequence length 0 (the attention kernel reads no key for them), and
their outputs are ignored. The attention metadata is built once per captured size over the static buffers, with the
split-K count fixed for that size, so the capture and every replay launch the same kernels. All graphs share one
memory pool and are captured largest first, so the smaller ones reuse its blocks. With LoRA the graphs are captured
with the adapter path on over a static mapping (`lora`; padded rows and base rows: slot -1, no term), so a batch
mixing adapters replays them too.

Lazy capture (compilation_config lazy_cudagraph_capture): the start captures the sizes up to LAZY_START_MAX and the
largest (which sizes the pool); any other size is captured the first time a step pads to it (a pause of one capture,
tens of milliseconds, on that step only), so the first token comes sooner and sizes never used cost nothing.

Verify batches (q_len > 1, speculative decoding): every row holds q_len query tokens. A row with fewer (fewer
drafts) is padded on the left: its pad tokens sit before its real ones, write no KV (slot -1) and attend to keys the
request already has (the kernel places a row's queries at seq_len - q_len ..), so the real tokens see exactly the
keys they would eagerly. The outputs are gathered back to the flat batch's order on the device. An optional extra
static input (`extra`: an EAGLE head's hidden states) is passed to the model as its third argument.

A proposer's graphs may end with a head (`head`: a draft model's LM head and argmax), applied inside the graph to
each row's last token's output (with left padding, token (i + 1) * q_len - 1 of row i): such a graph's output is
per row, and successive decodes over the same rows (a draft's passes 2..K) load their inputs from the device
(load_step) without the host staging and its wait.

Pipeline stages (distributed/pipeline.py): each rank captures its own layers. A stage after the first takes the
previous stage's (hidden, residual) as a static input (`intermediate` [2, tokens, hidden], the model's third argument,
loaded after the receive); a stage before the last returns them as its static outputs. The sends and receives stay
outside the graphs.

Off CUDA (tests) the same static buffers run the model eagerly (`capture_graphs` False): the path is checked on CPU."""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from torch import nn

from pagedllm.forward_context import forward_context
from pagedllm.lora.mapping import StaticLoRAMapping

logger = logging.getLogger(__name__)

LAZY_START_MAX = 8  # with lazy capture, sizes up to this one are captured at start (and the largest)


def start_sizes(sizes: list[int], lazy: bool) -> list[int]:
    """The sizes captured at start: all, or with lazy capture those up to LAZY_START_MAX and the largest."""
    if not lazy or not sizes:
        return list(sizes)
    return [s for s in sizes if s <= LAZY_START_MAX or s == max(sizes)]


def capture_sizes(max_num_seqs: int, user_sizes: list[int] | None) -> list[int]:
    """Batch sizes to capture: the user's (compilation_config.cudagraph_capture_sizes) or vLLM-like
    1, 2, 4, then steps of 8 up to 64 and steps of 16 above, up to max_num_seqs (which is always included)."""
    if user_sizes is not None:
        return sorted({s for s in user_sizes if s <= max_num_seqs})
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, max_num_seqs + 1, 16))
    return sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs})


def stage_input(runner) -> tuple[int, torch.dtype] | None:
    """(hidden size, dtype) of the static (hidden, residual) input of a runner's graphs on a pipeline stage after
    the first; None on the first stage or without stages."""
    return None if runner.stage is None else runner.stage.graph_input()


def make_graph_runner(runner, max_blocks: int) -> CudaGraphRunner | None:
    """A runner's decode graphs: on CUDA with a backend that supports them, unless enforce_eager or no capture size
    (a pipeline stage captures its own layers)."""
    config = runner.config
    if not runner.on_cuda or config.device.enforce_eager or not runner.backend.SUPPORTS_CUDA_GRAPHS:
        return None
    sizes = capture_sizes(config.scheduler.max_num_seqs, config.compilation.cudagraph_capture_sizes)
    if not sizes:
        return None
    lora = None if runner.lora is None else StaticLoRAMapping(max(sizes), runner.lora.config.max_loras, runner.device)
    return CudaGraphRunner(
        runner.model, runner.backend, sizes, max_blocks, runner.block_size, runner.max_model_len, runner.num_kv_heads,
        runner.device, lora, config.compilation.lazy_cudagraph_capture, intermediate=stage_input(runner),
    )  # fmt: skip


class CudaGraphRunner:
    """Static buffers, per-size attention metadata and graphs of the model's forward for batches of q_len tokens per
    row (1: decodes)."""

    def __init__(
        self,
        model: nn.Module,
        backend,
        sizes: list[int],
        max_blocks: int,
        block_size: int,
        max_model_len: int,
        num_kv_heads: int,
        device: torch.device,
        lora=None,
        lazy: bool = False,
        q_len: int = 1,
        extra: tuple[int, torch.dtype] | None = None,
        intermediate: tuple[int, torch.dtype] | None = None,
        head=None,
    ) -> None:
        self.model, self.backend, self.sizes = model, backend, sorted(sizes)
        self.lora = lora  # StaticLoRAMapping (lora/mapping.py) of max_size * q_len tokens; None: LoRA is off
        self.lazy = lazy  # sizes outside start_sizes are captured when first used
        self.q_len = q_len  # query tokens per row
        self.head = head  # None, or (each row's last token's output [bs, hidden]) -> per-row output [bs, ...]
        self.capture_graphs = device.type == "cuda"  # else the static buffers run eagerly (tests)
        self.max_size, self.max_blocks, self.device = self.sizes[-1], max_blocks, device
        n, t = self.max_size, self.max_size * q_len
        pin = self.capture_graphs
        # int64 rows: input ids, positions, cache slots, each flat token's row in the graph (q_len > 1); pinned host
        # staging and its device twin
        self.host_i64 = torch.zeros((4, t), dtype=torch.int64, pin_memory=pin)  # [4, max_size * q_len]
        self.dev_i64 = torch.zeros((4, t), dtype=torch.int64, device=device)  # [4, max_size * q_len]
        # int32: seq_lens [max_size], then the block table [max_size, max_blocks] flattened
        self.host_i32 = torch.zeros(n + n * max_blocks, dtype=torch.int32, pin_memory=pin)
        self.dev_i32 = torch.zeros(n + n * max_blocks, dtype=torch.int32, device=device)
        # [max_size + 1], never changes: row i's queries are tokens i * q_len .. (i + 1) * q_len - 1
        self.query_start_loc = torch.arange(0, t + 1, q_len, dtype=torch.int32, device=device)
        # [max_size * q_len, width]: the model's third input (an EAGLE head's hidden states), or None
        self.extra = None if extra is None else torch.zeros(t, extra[0], dtype=extra[1], device=device)
        # [2, max_size * q_len, hidden]: a later pipeline stage's input (hidden, residual), or None
        self.intermediate = None
        if intermediate is not None:
            self.intermediate = torch.zeros(2, t, intermediate[0], dtype=intermediate[1], device=device)
        self.copy_done = torch.cuda.Event() if self.capture_graphs else None
        self.metas = {bs: self._metadata(bs, block_size, max_model_len, num_kv_heads) for bs in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # captured size -> static output [bs * q_len, hidden] (or tuple)
        self.pool = None
        self.num_replays = 0
        self.capture_seconds = 0.0

    def _metadata(self, bs: int, block_size: int, max_model_len: int, num_kv_heads: int):
        n, t = self.max_size, bs * self.q_len
        num_splits = self.backend.choose_num_splits(
            bs * num_kv_heads, max_model_len, self.q_len, self.backend.num_sms(self.device)
        )
        return self.backend.static_decode_metadata(
            slot_mapping=self.dev_i64[2, :t],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.dev_i32[:bs],
            block_table=self.dev_i32[n : n + bs * self.max_blocks].view(bs, self.max_blocks),
            block_size=block_size,
            max_seq_len=max_model_len,
            num_splits=num_splits,
            max_query_len=self.q_len,
        )

    def padded_size(self, num_reqs: int) -> int | None:
        """The smallest capture size that holds num_reqs rows (None: run eagerly); with lazy capture, a size not
        captured yet is captured now."""
        if num_reqs > self.max_size or (self.capture_graphs and self.pool is None):
            return None
        bs = next(s for s in self.sizes if s >= num_reqs)
        if bs not in self.graphs and self.capture_graphs:
            start = time.perf_counter()
            self._capture_one(bs)
            torch.cuda.synchronize(self.device)
            self.capture_seconds += time.perf_counter() - start
            logger.debug("captured the CUDA graph of batch size %d (%d tokens per row) on first use", bs, self.q_len)
        return bs

    def clear_inputs(self) -> None:
        """Inputs that write no KV (slot -1) and read no key (sequence length 0): for warm-ups and profiling."""
        self.dev_i64[2].fill_(-1)
        self.dev_i32[: self.max_size].zero_()
        if self.intermediate is not None:
            self.intermediate.zero_()
        if self.lora is not None:
            self.lora.clear()

    def forward_eager(self, bs: int):
        """The model over the static buffers of size bs, without a graph (warm-up, profiling, tests)."""
        t = bs * self.q_len
        extra = () if self.extra is None else (self.extra[:t],)
        if self.intermediate is not None:
            extra = ((self.intermediate[0, :t], self.intermediate[1, :t]),)
        with forward_context(self.metas[bs], self.lora.view(t) if self.lora is not None else None):
            out = self.model(self.dev_i64[0, :t], self.dev_i64[1, :t], *extra)  # [t, hidden] (or a tuple)
        return out if self.head is None else self.head(out[self.q_len - 1 :: self.q_len])  # (head: [bs, ...])

    @torch.inference_mode()
    def capture(self, pool=None) -> float:
        """Captures the start sizes (every size unless lazy), largest first, into one pool (pool: another runner's,
        shared); returns the seconds it took."""
        start = time.perf_counter()
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        sizes = start_sizes(self.sizes, self.lazy)
        for bs in reversed(sizes):
            self._capture_one(bs)
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        self.capture_seconds += seconds
        later = f", {len(self.sizes) - len(sizes)} more when first used" if self.lazy else ""
        logger.info(
            "captured %d CUDA graphs (batch sizes %s%s, %d tokens per row) in %.2f s",
            len(sizes), sizes, later, self.q_len, seconds,
        )  # fmt: skip
        return seconds

    @torch.inference_mode()
    def _capture_one(self, bs: int) -> None:
        self.clear_inputs()  # warm-up and capture write no KV
        self.forward_eager(bs)  # compiles the Triton variants and sets up cuBLAS outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[bs] = self.forward_eager(bs)
        self.graphs[bs] = graph

    def load_inputs(
        self, bs, input_ids, positions, slots, seq_lens, block_table, late=None, lora_slots=None, query_lens=None
    ) -> None:
        """Host arrays of n <= bs rows into the static buffers, rows n..bs as padding; one copy per dtype.
        input_ids, positions, slots: [num_tokens] flat; query_lens [n] each row's tokens (None: one each), at most
        q_len. late: (places in input_ids, values) of input tokens still on the device (the previous step sampled
        them). lora_slots: each token's adapter slot [num_tokens] (-1: none; None: no token uses one), with LoRA on."""
        n, q, t = len(seq_lens), self.q_len, bs * self.q_len
        if self.copy_done is not None:
            self.copy_done.synchronize()  # the previous step's copy has left the staging buffers
        h64 = self.host_i64.numpy()
        h64[:2, :t], h64[2, :t] = 0, -1  # padding: token 0 at position 0, no KV write
        dest = self._places(query_lens, n, len(input_ids))  # [num_tokens] each token's row in the graph
        h64[0, dest], h64[1, dest], h64[2, dest] = input_ids, positions, slots
        h64[3, : len(dest)] = dest
        h32 = self.host_i32.numpy()
        h32[:n], h32[n:bs] = seq_lens, 0
        table = h32[self.max_size : self.max_size + bs * self.max_blocks].reshape(bs, self.max_blocks)
        width = min(block_table.shape[1], self.max_blocks)
        table[:n, :width] = block_table[:, :width]
        self.dev_i64.copy_(self.host_i64, non_blocking=True)
        end = self.max_size + bs * self.max_blocks
        self.dev_i32[:end].copy_(self.host_i32[:end], non_blocking=True)
        if self.lora is not None:  # (its staging is reused after the same wait)
            padded = None
            if lora_slots is not None:
                padded = np.full(t, -1, dtype=np.int64)
                padded[dest] = lora_slots
            self.lora.load(padded, t)
        if self.copy_done is not None:
            self.copy_done.record()
        if late is not None:
            self.dev_i64[0].index_copy_(0, self.dev_i64[3, : len(dest)][late[0]] if q > 1 else late[0], late[1])

    def load_step(self, input_ids: torch.Tensor, values: torch.Tensor | None = None) -> None:
        """A decode (q_len 1) over the rows and block tables of the last load_inputs, its inputs from the device: no
        host staging, so no wait. input_ids [n] into the first n rows (the padding rows keep token 0); values
        [3, bs] int64: positions, slots, seq_lens of all bs rows (padding rows: 0, -1, 0), None: unchanged."""
        self.dev_i64[0, : len(input_ids)].copy_(input_ids)
        if values is not None:
            bs = values.shape[1]
            self.dev_i64[1:3, :bs].copy_(values[:2])
            self.dev_i32[:bs].copy_(values[2])

    def _static(self, bs: int, out):
        """An eager run's outputs copied into size bs's output buffers (made at first use), as a graph's replay
        returns them."""
        outs = out if isinstance(out, tuple) else (out,)
        kept = self.outputs.get(bs)
        kept = kept if isinstance(kept, tuple) else (kept,)
        if kept[0] is None or any(k.shape != o.shape or k.dtype != o.dtype for k, o in zip(kept, outs)):
            kept = tuple(torch.empty_like(o) for o in outs)
            self.outputs[bs] = kept if isinstance(out, tuple) else kept[0]
        for k, o in zip(kept, outs):
            k.copy_(o)
        return self.outputs[bs]

    def _places(self, query_lens, n: int, num_tokens: int) -> np.ndarray:
        """Each flat token's row in the graph's layout: row i's tokens end at (i + 1) * q_len (left padding)."""
        if query_lens is None or self.q_len == 1:
            assert num_tokens == n, "a decode graph takes one token per row"
            return np.arange(num_tokens)
        query_lens = np.asarray(query_lens, dtype=np.int64)
        assert query_lens.max() <= self.q_len, "a row with more tokens than the graph's q_len"
        first = np.arange(1, n + 1) * self.q_len - query_lens  # [n] each row's first real token
        starts = np.cumsum(query_lens) - query_lens  # [n] each row's first token in the flat batch
        return np.repeat(first - starts, query_lens) + np.arange(num_tokens)

    def load_extra(self, values: torch.Tensor) -> None:
        """The extra input's rows [num_tokens, width] (device, flat order) into the graph's rows (after load_inputs)."""
        self.extra.index_copy_(0, self.dev_i64[3, : len(values)], values)

    def load_intermediate(self, bs: int, pair: torch.Tensor) -> None:
        """The previous pipeline stage's (hidden, residual) [2, num_tokens, hidden] (flat order) into the rows of
        the graph of size bs (after load_inputs); its padding rows zero, as their token ids are."""
        self.intermediate[:, : bs * self.q_len].zero_()
        self.intermediate.index_copy_(1, self.dev_i64[3, : pair.shape[1]], pair)

    def replay(self, bs: int, num_tokens: int):
        """Runs the graph of size bs over the loaded inputs (off CUDA: the model eagerly over them); its rows of the
        num_tokens flat tokens, [num_tokens, hidden] (or a tuple of them). With a head: the head's outputs of the
        first num_tokens rows (num_tokens counts rows)."""
        self.num_replays += 1
        if bs in self.graphs:
            self.graphs[bs].replay()
            out = self.outputs[bs]
        else:  # (off CUDA) into static outputs too: a caller keeping a replay's output sees the next replay write it
            out = self._static(bs, self.forward_eager(bs))
        if self.q_len == 1 or self.head is not None:
            return tuple(o[:num_tokens] for o in out) if isinstance(out, tuple) else out[:num_tokens]
        index = self.dev_i64[3, :num_tokens]
        return tuple(o.index_select(0, index) for o in out) if isinstance(out, tuple) else out.index_select(0, index)

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
tens of milliseconds, on that step only), so the first token comes sooner and sizes never used cost nothing."""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from pagedllm.forward_context import forward_context

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


class CudaGraphRunner:
    """Static buffers, per-size attention metadata and graphs of the model's forward for decode batches."""

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
    ) -> None:
        self.model, self.backend, self.sizes = model, backend, sorted(sizes)
        self.lora = lora  # StaticLoRAMapping (lora/mapping.py) of max_size tokens; None: LoRA is off
        self.lazy = lazy  # sizes outside start_sizes are captured when first used
        self.max_size, self.max_blocks, self.device = self.sizes[-1], max_blocks, device
        n = self.max_size
        # int64 rows: input ids, positions, cache slots; pinned host staging and its device twin
        self.host_i64 = torch.zeros((3, n), dtype=torch.int64, pin_memory=True)  # [3, max_size]
        self.dev_i64 = torch.zeros((3, n), dtype=torch.int64, device=device)  # [3, max_size]
        # int32: seq_lens [max_size], then the block table [max_size, max_blocks] flattened
        self.host_i32 = torch.zeros(n + n * max_blocks, dtype=torch.int32, pin_memory=True)
        self.dev_i32 = torch.zeros(n + n * max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # [max_size + 1], never changes
        self.copy_done = torch.cuda.Event()
        self.metas = {bs: self._metadata(bs, block_size, max_model_len, num_kv_heads) for bs in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # captured size -> static hidden output [bs, hidden]
        self.pool = None
        self.num_replays = 0
        self.capture_seconds = 0.0

    def _metadata(self, bs: int, block_size: int, max_model_len: int, num_kv_heads: int):
        n = self.max_size
        num_splits = self.backend.choose_num_splits(
            bs * num_kv_heads, max_model_len, 1, self.backend.num_sms(self.device)
        )
        return self.backend.static_decode_metadata(
            slot_mapping=self.dev_i64[2, :bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.dev_i32[:bs],
            block_table=self.dev_i32[n : n + bs * self.max_blocks].view(bs, self.max_blocks),
            block_size=block_size,
            max_seq_len=max_model_len,
            num_splits=num_splits,
        )

    def padded_size(self, num_reqs: int) -> int | None:
        """The smallest capture size that holds num_reqs decodes (None: run eagerly); with lazy capture, a size
        not captured yet is captured now."""
        if num_reqs > self.max_size or not self.graphs:
            return None
        bs = next(s for s in self.sizes if s >= num_reqs)
        if bs not in self.graphs:
            start = time.perf_counter()
            self._capture_one(bs)
            torch.cuda.synchronize(self.device)
            self.capture_seconds += time.perf_counter() - start
            logger.debug("captured the CUDA graph of decode batch size %d on first use", bs)
        return bs

    def clear_inputs(self) -> None:
        """Inputs that write no KV (slot -1) and read no key (sequence length 0): for warm-ups and profiling."""
        self.dev_i64[2].fill_(-1)
        self.dev_i32[: self.max_size].zero_()
        if self.lora is not None:
            self.lora.clear()

    def forward_eager(self, bs: int) -> torch.Tensor:
        """The model over the static buffers of size bs, without a graph (warm-up, profiling, tests)."""
        with forward_context(self.metas[bs], self.lora.view(bs) if self.lora is not None else None):
            return self.model(self.dev_i64[0, :bs], self.dev_i64[1, :bs])  # [bs, hidden]

    @torch.inference_mode()
    def capture(self) -> float:
        """Captures the start sizes (every size unless lazy), largest first, into one pool; returns the seconds it
        took."""
        start = time.perf_counter()
        self.pool = torch.cuda.graph_pool_handle()
        sizes = start_sizes(self.sizes, self.lazy)
        for bs in reversed(sizes):
            self._capture_one(bs)
        torch.cuda.synchronize(self.device)
        seconds = self.capture_seconds = time.perf_counter() - start
        later = f", {len(self.sizes) - len(sizes)} more when first used" if self.lazy else ""
        logger.info("captured %d CUDA graphs (decode batch sizes %s%s) in %.2f s", len(sizes), sizes, later, seconds)
        return seconds

    @torch.inference_mode()
    def _capture_one(self, bs: int) -> None:
        self.clear_inputs()  # warm-up and capture write no KV
        self.forward_eager(bs)  # compiles the Triton variants and sets up cuBLAS outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[bs] = self.forward_eager(bs)
        self.graphs[bs] = graph

    def load_inputs(self, bs: int, input_ids, positions, slots, seq_lens, block_table, late=None, lora_slots=None):
        """Host arrays of n <= bs decodes into the static buffers, rows n..bs as padding; one copy per dtype.
        late: (places in input_ids, values) of input tokens still on the device (the previous step sampled them).
        lora_slots: each row's adapter slot [n] (-1: none; None: no row uses one), with LoRA on."""
        n = len(input_ids)
        self.copy_done.synchronize()  # the previous step's copy has left the staging buffers
        h64 = self.host_i64.numpy()
        h64[0, :n], h64[1, :n], h64[2, :n] = input_ids, positions, slots
        h64[:2, n:bs], h64[2, n:bs] = 0, -1  # padding: token 0 at position 0, no KV write
        h32 = self.host_i32.numpy()
        h32[:n], h32[n:bs] = seq_lens, 0
        table = h32[self.max_size : self.max_size + bs * self.max_blocks].reshape(bs, self.max_blocks)
        width = min(block_table.shape[1], self.max_blocks)
        table[:n, :width] = block_table[:, :width]
        self.dev_i64.copy_(self.host_i64, non_blocking=True)
        end = self.max_size + bs * self.max_blocks
        self.dev_i32[:end].copy_(self.host_i32[:end], non_blocking=True)
        if self.lora is not None:  # (its staging is reused after the same wait)
            self.lora.load(lora_slots, n)
        self.copy_done.record()
        if late is not None:
            self.dev_i64[0].index_copy_(0, *late)

    def replay(self, bs: int, num_tokens: int) -> torch.Tensor:
        """Runs the graph of size bs over the loaded inputs; the first num_tokens rows of its output [bs, hidden]."""
        self.graphs[bs].replay()
        self.num_replays += 1
        return self.outputs[bs][:num_tokens]

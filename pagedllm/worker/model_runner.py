"""ModelRunner: applies the scheduler's delta to the persistent batch, builds one flat varlen batch over the paged
KV cache, runs the model and samples the requests that reached the end of their known tokens."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention import get_backend
from pagedllm.attention.common import BatchLayout
from pagedllm.config import EngineConfig
from pagedllm.device import HostCopies, to_device
from pagedllm.distributed.parallel_state import ParallelGroups, kv_heads_per_rank
from pagedllm.distributed.pipeline import PendingStep, PipelineStage, Received, pipeline_step
from pagedllm.forward_context import forward_context
from pagedllm.layers.attention import Attention
from pagedllm.lora.manager import make_lora_manager
from pagedllm.model_loader.loader import get_model
from pagedllm.multimodal.encoder_runner import make_multimodal_runner
from pagedllm.sample.custom_batch import CustomLogitsProcessors
from pagedllm.sample.impl import TRITON
from pagedllm.sample.step_sampler import SamplerOutput, StepSampler
from pagedllm.sample.verify import accept, logits_positions
from pagedllm.sample.vocab_race import RaceStep, VocabRace, plain_rows
from pagedllm.spec_decode.device_drafts import DeviceDrafts, resolve
from pagedllm.spec_decode.draft_model import make_drafter
from pagedllm.startup import StartupTimer
from pagedllm.worker.cuda_graphs import make_graph_runner
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.kernel_warmup import KernelPrecompile, first_steps, sampler_steps
from pagedllm.worker.prompt_embeds import forward_with_prompt_embeds, step_embeds
from pagedllm.worker.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.worker.step_future import StepFuture
from pagedllm.worker.verify_graphs import make_verify_graphs, pick_graph


@dataclass
class FlatBatch:
    """The step's scheduled tokens as host arrays, one flat varlen batch."""

    input_ids: np.ndarray  # [num_tokens]
    positions: np.ndarray  # [num_tokens]
    slots: np.ndarray  # [num_tokens] cache slot of each token
    query_start_loc: np.ndarray  # [num_reqs + 1]
    seq_lens: np.ndarray  # [num_reqs] context + scheduled tokens
    block_table: np.ndarray  # [num_reqs, max_blocks]
    req_ids: list[str]  # [num_reqs] in batch order
    rows: np.ndarray  # [num_reqs] persistent-batch row of each request
    token_rows: np.ndarray  # [num_tokens] persistent-batch row of each token
    sample_mask: np.ndarray  # [num_reqs] whether the request samples a token this step


@dataclass
class StepPlan:
    """A step's flat batch and its sampled rows, between the forward's launch and the sampling."""

    flat: FlatBatch
    spec: dict[str, list[int]]  # the drafts each request verifies
    req_ids: list[str] | None = None  # the requests that sample, in sampled order (None: none)
    bitmasks: Mapping | None = None  # req id -> allowed-token mask of the masked requests (None: none)
    rows: np.ndarray | None = None  # [num_sampled] their persistent-batch rows
    num_tokens: np.ndarray | None = None  # [num_sampled] their tokens so far
    num_drafts: np.ndarray | None = None  # [num_sampled] their drafts (None: a step without)
    drafts: list[list[int]] | None = None
    device_drafts: DeviceDrafts | None = None  # the proposal whose placeholder drafts (UNKNOWN) this step verifies
    late: tuple[torch.Tensor, torch.Tensor] | None = None  # (places, values) of input ids still on the device
    logits_rows: torch.Tensor | None = None  # [num_sampled (+ drafts)] rows of the hidden states to sample from


class ModelRunner:
    """One rank's runner. With tensor parallelism every rank of the group runs the same steps on its shard of the
    model; the driver (rank 0) samples and broadcasts the sampled tokens, which every rank keeps in its batch (a
    plain step: every rank samples over its slice of the vocabulary, sample/vocab_race.py). With
    pipeline stages a step is split in two (distributed/pipeline.py)."""

    def __init__(self, config: EngineConfig, groups: ParallelGroups | None = None) -> None:
        self.config = config
        self.device = config.device.device
        self.groups = groups if groups is not None else ParallelGroups.single(self.device)
        self.is_driver = self.groups.info.is_driver
        self.block_size = config.cache.block_size
        self.max_model_len = config.model.max_model_len
        self.num_kv_heads = kv_heads_per_rank(config.model.num_kv_heads, self.groups.info.tp_size)
        self.kv_cache_dtype = config.cache.kv_cache_dtype(config.model.dtype)  # FP8 halves the bytes per block
        self.startup = StartupTimer()  # seconds per start-up phase (pagedllm/startup.py)
        self.on_cuda = self.device.type == "cuda"
        self.stage = PipelineStage.of(self.groups, config.model)  # this rank's pipeline stage (None: one stage)
        max_blocks = -(-self.max_model_len // self.block_size)
        self.batch = InputBatch(config.scheduler.max_num_seqs, self.max_model_len, max_blocks)
        self.batch.custom_logits = bool(config.logits_processors)  # (a follower's: their names; the driver runs them)
        procs = config.logits_processors  # engine-wide LogitsProcessor classes: the driver builds and runs them
        custom = CustomLogitsProcessors(procs, config, self.device) if procs and self.is_driver else None
        with self.startup.phase("compile"):  # (the CPU's C kernels build here, once per machine)
            self.sampler = StepSampler(self.batch, self.device, config.model.seed, custom)
        self.race: VocabRace | None = None  # plain steps' sampling over each rank's slice of the vocabulary
        # GPU: the first steps' Triton kernels compile on a thread pool while the model is built (kernel_warmup)
        with KernelPrecompile(self, config.compilation.compile_threads) as precompile:
            precompile.record(sampler_steps)
            self._build_model(max_blocks)
            precompile.record(first_steps)
            with self.startup.phase("compile"):
                precompile.finish()

    def _build_model(self, max_blocks: int) -> None:
        config = self.config
        with self.startup.phase("weights"):
            context = self.groups.build_context()
            self.model = get_model(config.model, self.device, context)
        self.lora = make_lora_manager(config, self.model, self.device, context)  # None: LoRA is off
        with self.startup.phase("compile"):
            self.backend = get_backend(config.device.attention_backend, self.device)
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        # req_id -> the request's logits processors: callables stay in the engine's process (registered there),
        # the step message carries none
        self.logits_processors: dict[str, list[Callable]] = {}
        self.graphs = make_graph_runner(self, max_blocks)  # None: every step runs eagerly
        self.verify_graphs = make_verify_graphs(self, self.graphs)  # speculative verify steps (None: eagerly)
        self.last_graph = None  # the graph runner of the latest forward (None: it ran eagerly)
        self.memory_profile: dict[str, int] | None = None  # set by the GPU memory profile (gpu_memory)
        self.last_step: StepFuture | None = None  # the newest launched step that samples
        self.host_copies = HostCopies()  # pinned buffers the steps' sampled tokens and logprobs come back through
        with self.startup.phase("weights"):
            self.drafter = make_drafter(config, self)  # the draft model of speculative decoding, if any
            self.mm = make_multimodal_runner(self.model, config)  # None: a text-only model
        head = self.model.logits_head() if hasattr(self.model, "logits_head") else None
        if self.sampler.impl == TRITON and self.stage is None and self.drafter is None and head is not None:
            self.race = VocabRace(self.device, config.model.seed, config.scheduler.max_num_seqs, head)

    def kv_bytes_per_block(self) -> int:
        m = self.config.model
        per_layer = 2 * self.block_size * self.num_kv_heads * m.head_dim * self.kv_cache_dtype.itemsize
        draft = self.drafter.kv_bytes_per_block() if self.drafter is not None else 0  # the same block ids
        return per_layer * len(self.attn_layers) + draft

    def allocate_kv_cache(self, num_blocks: int) -> None:
        with self.startup.phase("kv_cache"):
            self._allocate_kv_cache(num_blocks)

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        m = self.config.model
        for layer in self.attn_layers:  # each backend lays its cache out in memory as its kernels read it best
            if (layer.num_kv_heads, layer.head_dim) != (self.num_kv_heads, m.head_dim):  # too small corrupts memory
                raise ValueError(
                    f"{m.architecture}: attention has {layer.num_kv_heads} KV heads of {layer.head_dim} dims, the "
                    f"config says {self.num_kv_heads} of {m.head_dim} per rank"
                )
            layer.kv_cache = self.backend.allocate_kv_cache(
                num_blocks, self.block_size, self.num_kv_heads, m.head_dim, self.kv_cache_dtype, self.device
            )
            layer.backend = self.backend
        if self.drafter is not None:
            self.drafter.allocate_kv_cache(num_blocks)

    def capture_cudagraphs(self) -> float:
        """Captures the decode graphs over the allocated KV cache (CUDA only); returns the seconds it took."""
        with self.startup.phase("graph_capture"):
            seconds = self.graphs.capture() if self.graphs is not None else 0.0
            if self.verify_graphs is not None:  # in the decode graphs' pool
                seconds += self.verify_graphs.capture(self.graphs.pool)
            return seconds + (self.drafter.capture_cudagraphs() if self.drafter is not None else 0.0)

    def available_kv_cache_bytes(self) -> int | None:
        """On CUDA: the KV-cache budget found by profiling one forward (see gpu_memory); None elsewhere."""
        if not self.on_cuda:
            return None
        from pagedllm.worker.gpu_memory import available_kv_cache_bytes

        with self.startup.phase("kv_profile"):
            return available_kv_cache_bytes(self)

    def add_lora(self, request) -> bool:
        """Reads and checks a LoRA adapter (ValueError) and keeps its host copy; False if it was known."""
        if self.lora is None:
            raise ValueError("lora_request: LoRA is off; create the engine with enable_lora=True")
        return self.lora.add(request)

    def register_logits_processors(self, req_id: str, processors: list[Callable]) -> None:
        """A request's logits processors, kept here until it finishes (in the engine's process)."""
        self.logits_processors[req_id] = list(processors)

    # -- applying the scheduler's delta -------------------------------------------------------------------------
    def _update_batch(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.batch.remove(req_id)
        new_ids = {new.req_id for new in so.new_reqs}
        for req_id in so.finished_req_ids - new_ids:  # (an id used again by a new request keeps the new one's)
            self.logits_processors.pop(req_id, None)
        for new in so.new_reqs:
            if new.lora_request is not None:  # known already (checked when the request was made)
                self.add_lora(new.lora_request)
            self.batch.remove(new.req_id)  # a resumed request re-enters with all its blocks
            if not new.has_logits_processors:  # (an entry of an earlier request with this id: not this one's)
                self.logits_processors.pop(new.req_id, None)
            self.batch.add(new, self.logits_processors.get(new.req_id))
        for cached in so.cached_reqs:
            row = self.batch.row_of[cached.req_id]
            self.batch.append_blocks(row, cached.new_block_ids)
            self.batch.num_computed[row] = cached.num_computed_tokens

    # -- building the flat batch --------------------------------------------------------------------------------
    def _prepare_inputs(self, so: SchedulerOutput) -> FlatBatch:
        b = self.batch
        req_ids = list(so.num_scheduled_tokens)
        rows = np.array([b.row_of[r] for r in req_ids], dtype=np.int64)  # [num_reqs]
        num_sched = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=len(rows))
        cu = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(num_sched, out=cu[1:])
        total = int(cu[-1])
        req_idx = np.repeat(np.arange(len(rows)), num_sched)  # [num_tokens] request of each token
        computed = b.num_computed[rows]
        positions = computed[req_idx] + np.arange(total) - cu[req_idx]  # [num_tokens]
        token_rows = rows[req_idx]
        input_ids = b.token_ids[token_rows, positions]  # [num_tokens] (a token still on the device: stale)
        slots = b.block_table[token_rows, positions // self.block_size] * self.block_size  # [num_tokens]
        slots += positions % self.block_size
        seq_lens = computed + num_sched  # [num_reqs]
        # reached the end of its tokens (the last maybe still on the device, async scheduling): samples one
        sample_mask = seq_lens >= b.num_tokens[rows]
        table = b.block_table[rows]
        return FlatBatch(input_ids, positions, slots, cu, seq_lens, table, req_ids, rows, token_rows, sample_mask)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.launch(so).result()

    @torch.inference_mode()
    def launch(self, so: SchedulerOutput) -> StepFuture:
        """Queues the step on the device and returns at once; its result() waits for the sampled tokens. The
        previous step may still be running: its sampled tokens feed this step's inputs on the device."""
        self._update_batch(so)
        if self.mm is not None:
            self.mm.update(so)
        if not so.num_scheduled_tokens:
            return StepFuture.ready(ModelRunnerOutput({}))
        if self.stage is not None:  # (pipeline_step: a later stage sends on, the first returns a PendingStep)
            return pipeline_step(self, so)
        self._wait_for_host_outputs(so)
        plan = self.plan_step(so)
        late = plan.late if plan.spec else self._late_inputs(plan.flat)
        if getattr(so.grammar_bitmask, "pending", False):  # masks still being filled: read after the forward is queued
            hidden = self._run_model(plan.flat, late)
            if so.grammar_bitmask.deferred:  # filled after the previous step's update: sampled when the engine asks
                return PendingStep(self, plan, Received(None, hidden))
            return self.finish_step(plan, hidden, self.prepare_sampling(plan))
        step = self.prepare_sampling(plan)  # the sampler's uploads come before the forward on the device's queue
        return self.finish_step(plan, self._run_model(plan.flat, late), step)

    def plan_step(self, so: SchedulerOutput) -> StepPlan:
        """The step's flat batch and which of its rows sample (their logits rows uploaded now)."""
        spec = so.scheduled_spec_decode_tokens
        pending = getattr(self.drafter, "pending", None)
        if spec:  # a penalized request's drafts are read now: its penalties count them (spec_decode/device_drafts.py)
            resolve(spec, pending, [r for r in spec if self.batch.penalized[self.batch.row_of[r]]])
            self.batch.write_drafts(spec)
        flat = self._prepare_inputs(so)
        plan = StepPlan(flat, spec, device_drafts=pending)
        if spec and pending is not None:  # the drafts still on the device fill their input ids there
            ends = flat.query_start_loc[1:]
            plan.late = pending.fill_inputs(flat.req_ids, [spec.get(r, ()) for r in flat.req_ids], ends)
        sample_idx = np.flatnonzero(flat.sample_mask)  # [num_sampled] the requests that sample this step
        if not len(sample_idx):
            return plan
        plan.req_ids = [flat.req_ids[i] for i in sample_idx.tolist()]
        plan.bitmasks = so.grammar_bitmask or None  # (read in prepare_sampling: they may still be being filled)
        logits_rows = flat.query_start_loc[1:][sample_idx] - 1  # [num_sampled]
        plan.rows, plan.num_tokens = flat.rows[sample_idx], flat.seq_lens[sample_idx]
        if spec:  # a target token at each request's last known position and at each of its draft positions
            drafts = [spec.get(r, []) for r in plan.req_ids]
            plan.num_drafts = np.array([len(d) for d in drafts], dtype=np.int64)
            logits_rows = logits_positions(logits_rows + 1, plan.num_drafts)
            plan.num_tokens = plan.num_tokens - plan.num_drafts
            plan.drafts = drafts
        plan.logits_rows = self._to_device(logits_rows)  # [num_sampled (+ their drafts)]
        return plan

    def prepare_sampling(self, plan: StepPlan):
        """The driver's sampler inputs for the plan's sampled rows (other ranks: the rows; None: nothing samples)."""
        if plan.req_ids is None:
            return None
        if self.race is not None and plan.num_drafts is None and plain_rows(self.batch, plan.rows, plan.num_tokens):
            if self.sampler.resident is not None:  # its state does not advance past this step: rebuilt when next used
                self.sampler.resident.last = None
            return self.race.prepare(self.batch, plan.rows, plan.num_tokens)  # every rank: RaceStep
        if not self.is_driver:
            return plan.rows
        bitmasks = [plan.bitmasks.get(r) for r in plan.req_ids] if plan.bitmasks else None
        return self.sampler.prepare(plan.rows, plan.num_tokens, bitmasks, plan.num_drafts)

    def finish_step(self, plan: StepPlan, hidden: torch.Tensor, step) -> StepFuture:
        """After the forward (hidden [num_tokens, hidden]): prompt logprobs and the sampled tokens."""
        flat, spec = plan.flat, plan.spec
        if self.drafter is not None:  # an EAGLE head reads the target's hidden states
            self.drafter.record_step(flat, hidden, spec)
        prompt_lps = self._prompt_logprobs(hidden, flat)
        if step is None:
            return StepFuture.ready(ModelRunnerOutput({}, prompt_logprobs=prompt_lps))
        output = self._sample(hidden[plan.logits_rows], step, len(plan.logits_rows))
        if self.is_driver or isinstance(step, RaceStep):
            sampled_rows = step.rows
        else:
            sampled_rows = np.repeat(step, (plan.num_drafts + 1) if spec else 1)
        self.last_step = StepFuture(
            self, plan.req_ids, sampled_rows, output, prompt_lps, plan.drafts, plan.device_drafts
        )
        return self.last_step

    def _sample(self, hidden: torch.Tensor, step, n: int) -> SamplerOutput:
        """The driver samples n tokens from the logits of hidden [n, hidden]; the other ranks of its stage take part
        in the logits' gather. The sampled tokens reach every rank (with pipeline stages, the first stage's ranks
        only: the later ones take hidden states, not tokens). A plain step (RaceStep): every rank samples over its
        own slice of the vocabulary (sample/vocab_race.py)."""
        if isinstance(step, RaceStep):
            return SamplerOutput(self.race.sample(hidden, step, self.groups.tp), None)
        upcast = self.sampler.needs_float32(step) if self.is_driver else False
        logits = self.model.compute_logits(hidden, upcast)  # [n, vocab]
        if self.is_driver:
            output = self.sampler.sample(logits, step)
        else:
            output = SamplerOutput(torch.empty(n, dtype=torch.int64, device=self.device), None)
        (self.groups.tp if self.stage is not None else self.groups.world).broadcast(output.sampled, 0)
        return output

    def _wait_for_host_outputs(self, so: SchedulerOutput) -> None:
        """Penalties and the like read the output tokens on the host: where a row does, the previous step's tokens
        must have come back before its inputs are built."""
        prev = self.last_step
        if prev is None or prev.committed:
            return
        rows = np.array([self.batch.row_of[r] for r in so.num_scheduled_tokens], dtype=np.int64)
        if self.sampler.reads_outputs(rows).any():
            prev.result()

    def _run_model(self, flat: FlatBatch, late: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """hidden [num_tokens, hidden]: a pure-decode step replays the CUDA graph of the next captured size, a
        verify step (rows of at most K + 1 tokens) a verify graph (worker/verify_graphs.py); anything else (prefill
        chunks, batches above the largest size, CPU) runs eagerly. late: (positions in the
        flat batch, the previous step's sampled ids) of input tokens that are still on the device."""
        num_tokens = len(flat.input_ids)
        mm = None
        if self.mm is not None and (self.stage is None or self.stage.is_first):  # (the first stage embeds tokens)
            mm = self.mm.step_embeddings(flat.req_ids, flat.query_start_loc, flat.seq_lens, flat.block_table)
        elif self.mm is not None:  # a later stage: only where image tokens attend both ways (Gemma 3), their spans
            mm = self.mm.step_spans(flat.req_ids, flat.query_start_loc, flat.seq_lens, flat.block_table)
        # M-RoPE positions of a step with multimodal requests (Qwen2-VL): [3, num_tokens] or [num_tokens], else None
        mrope = None if self.mm is None else self.mm.step_positions(flat.req_ids, flat.query_start_loc, flat.positions)
        positions = flat.positions if mrope is None else mrope
        embeds = None  # (rows, embeddings) of a prompt chunk given as embeddings: worker/prompt_embeds.py
        if self.batch.prompt_embeds:
            embeds = step_embeds(self.batch, flat, self.device, self.config.model.dtype)
        picked = None  # a step with image tokens (spans), prompt embeddings or 3D positions runs eagerly
        if mm is None and embeds is None and positions.ndim == 1:
            picked = pick_graph(self.graphs, self.verify_graphs, np.diff(flat.query_start_loc))
        if picked is not None:  # decodes, or verify rows of at most K + 1 tokens: a graph of the padded size
            graphs, graph_bs, query_lens = picked
            lora_slots = self.lora.token_slots(self.batch.lora_id[flat.token_rows]) if self.lora is not None else None
            graphs.load_inputs(
                graph_bs, flat.input_ids, positions, flat.slots, flat.seq_lens, flat.block_table, late, lora_slots,
                query_lens,
            )  # fmt: skip
            self.last_graph = graphs  # (an EAGLE-3 head reads the target's layers in the graph's row order)
            if self.stage is not None:  # the previous stage's output into the graph's input, the result sent on
                return self.stage.run_graph(graphs, graph_bs, num_tokens)
            return graphs.replay(graph_bs, num_tokens)
        self.last_graph = None
        layout = BatchLayout(
            flat.query_start_loc,
            flat.seq_lens,
            flat.block_table,
            self._to_device(flat.slots),
            self.block_size,
            self.device,
        )
        meta = self.backend.build_metadata(layout)
        input_ids = self._to_device(flat.input_ids)
        if late is not None:
            input_ids.index_copy_(0, *late)
        lora = self.lora.mapping(self.batch.lora_id[flat.token_rows]) if self.lora is not None else None
        with forward_context(meta, lora):
            if self.stage is not None:  # this stage's layers, sent on (the first stage: the final hidden's receive)
                return self.stage.run(self.model, input_ids, self._to_device(positions), mm)
            return self.forward(input_ids, self._to_device(positions), mm, embeds)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, mm=None, embeds=None) -> torch.Tensor | None:
        """The model over the step's tokens (inside its forward context): hidden [num_tokens, hidden]; with
        pipeline parallelism through every stage and back (the memory profile's forward), and None on the stages
        after the first. mm: (flat rows [n], embeddings [n, hidden]) of image placeholder tokens (a vision-language
        model's); embeds: (flat rows [n], embeddings [n, hidden]) of prompt positions given as embeddings."""
        if embeds is not None:
            return forward_with_prompt_embeds(self.model, input_ids, positions, embeds)
        if self.stage is None:
            return self.model(input_ids, positions) if mm is None else self.model(input_ids, positions, mm_embeds=mm)
        final = self.stage.run(self.model, input_ids, positions, mm)
        return None if final is None else final.wait()

    def _late_inputs(self, flat: FlatBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Input tokens the previous step sampled that have not reached the host (async scheduling): their
        positions in the flat batch and their values, both on the device."""
        late = np.nonzero(flat.positions >= self.batch.num_tokens[flat.token_rows])[0]
        if not len(late):
            return None
        prev = self.last_step
        assert prev is not None and not prev.committed, "an input token that no running step samples"
        src = prev.index_of_row[flat.token_rows[late]]  # [num_late]
        if (src < 0).any():
            raise RuntimeError("async scheduling: an input token that the previous step did not sample")
        index = self._to_device(np.stack([late, src]))  # [2, num_late]
        return index[0], prev.sampled.index_select(0, index[1])

    def commit(self, step: StepFuture, sampled: list[int]) -> ModelRunnerOutput:
        """The step's sampled tokens enter the persistent batch (rows whose request left since are skipped)."""
        if step.drafts is not None:
            return self._commit_verified(step, sampled)
        out, out_logprobs = {}, {}
        logprobs = step.logprobs.tolists() if step.logprobs is not None else [None] * len(sampled)
        b = self.batch
        for req_id, row, gen, token, lp in zip(step.req_ids, step.rows.tolist(), step.generations, sampled, logprobs):
            if b.row_of.get(req_id) == row and b.generation[row] == gen:  # the same admission of the request
                b.append_token(row, token)
            out[req_id] = [token]
            if lp is not None:
                out_logprobs[req_id] = [lp]
        return ModelRunnerOutput(out, out_logprobs, step.prompt_logprobs)

    def _commit_verified(self, step: StepFuture, targets: list[int]) -> ModelRunnerOutput:
        """A step with drafts: per request, the accepted drafts and one sampled token (sample/verify.py), and their
        logprobs."""
        out, out_logprobs = {}, {}
        logprobs = step.logprobs.tolists() if step.logprobs is not None else None
        b, start = self.batch, 0
        drafts_of = dict(zip(step.req_ids, step.drafts))
        resolve(drafts_of, step.device_drafts, step.req_ids)  # (their copy came before the sampled tokens')
        verified = list(drafts_of.values())
        for req_id, drafts, tokens in zip(step.req_ids, verified, accept(verified, targets)):
            row, gen = int(step.rows[start]), step.generations[start]
            if b.row_of.get(req_id) == row and b.generation[row] == gen:
                for token in tokens:
                    b.append_token(row, token)
            out[req_id] = tokens
            if logprobs is not None and logprobs[start] is not None:
                out_logprobs[req_id] = logprobs[start : start + len(tokens)]
            start += len(drafts) + 1
        return ModelRunnerOutput(out, out_logprobs, step.prompt_logprobs)

    def _prompt_logprobs(self, hidden: torch.Tensor, flat: FlatBatch) -> dict:
        """For requests asking prompt_logprobs: the logprob of each prompt token this step's chunk predicts,
        as req_id -> (position of the first predicted token, [(ids, logprobs, ranks)] with the prompt token first)."""
        b = self.batch
        wanted = [i for i, r in enumerate(flat.rows.tolist()) if b.params[r].prompt_logprobs is not None]
        hidden_rows, targets, spans = [], [], {}
        for i in wanted:
            row = int(flat.rows[i])
            start = int(flat.seq_lens[i] - (flat.query_start_loc[i + 1] - flat.query_start_loc[i]))
            end = min(int(flat.seq_lens[i]), int(b.num_prompt[row]) - 1)  # positions predicting a prompt token
            if end <= start:
                continue
            first = int(flat.query_start_loc[i])
            hidden_rows.extend(range(first, first + end - start))
            targets.extend(b.token_ids[row, start + 1 : end + 1].tolist())
            spans[flat.req_ids[i]] = (start + 1, end - start, b.params[row].prompt_logprobs)
        if not spans:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(hidden_rows, device=self.device)])
        if not self.is_driver:  # (it took part in the logits' gather)
            return {}
        num_top = np.repeat([k for _, _, k in spans.values()], [count for _, count, _ in spans.values()])
        entries = self.sampler.token_logprobs(logits, torch.tensor(targets, device=self.device), num_top)
        out, offset = {}, 0
        for req_id, (first_pos, count, _) in spans.items():
            out[req_id] = (first_pos, entries[offset : offset + count])
            offset += count
        return out

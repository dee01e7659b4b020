"""EngineCore: one step = schedule -> execute -> update. Owns the scheduler and the executor. With async
scheduling two steps are in flight: a step waits for N's tokens, updates from them, schedules and launches N+2
behind N+1, then returns N's outputs (so their processing overlaps the device too). Where N+1's grammar masks need
N's tokens, its sampling waits: N's update, the masks filled while the caller processes N's outputs, N+1's
sampling queued, then N+2 launched. With a
speculative proposer each synchronous update is followed by a proposal of draft tokens for the next step. Drafts
need synchronous steps (a request's last token must be known to draft after it): with both, steps run
asynchronously without drafts while the batch is above disable_by_batch_size, and synchronously with drafts
otherwise (the step on the device ends first).

With pipeline parallelism (pp_size stages, no speculative proposer) up to pp_size steps are in flight, oldest first
in a queue: a step schedules and launches one more while the queue has room and something is schedulable, else it
takes the oldest: queues its sampling on the device, schedules and launches the same batch's next step (its inputs
the sampled tokens, still on the device), then waits for the tokens and updates from them. The scheduler skips the
requests with a step in flight (but the one being sampled), so the batches in flight are disjoint and every stage
has work, and the host's work for a batch overlaps the device's (distributed/pipeline.py)."""

from __future__ import annotations

import logging
import os
from collections import deque
from dataclasses import dataclass

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.scheduler import EngineCoreOutput, Scheduler
from pagedllm.spec_decode.config import MODEL_METHODS
from pagedllm.spec_decode.policy import DraftPolicy
from pagedllm.worker.executor import make_executor
from pagedllm.worker.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

_GiB = 1 << 30
_GRAMMAR_WAIT_S = 0.05  # a step with nothing to run waits this long at most for a grammar being compiled


def default_cpu_kv_cache_bytes() -> int:
    """On CPU with no kv_cache_memory_bytes: VLLM_CPU_KVCACHE_SPACE GiB, else a quarter of the available memory, at
    most 4 GiB (vLLM's default)."""
    configured = envs.cpu_kvcache_space_bytes()
    if configured is not None:
        return configured
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        available = 8 * _GiB
    return int(min(4 * _GiB, available // 4))


@dataclass(eq=False)
class Launched:
    """A step on the device (async scheduling)."""

    so: SchedulerOutput
    future: object  # StepFuture, or PendingStep while its sampling waits for its masks
    masks_wait: bool  # its masks wait for the previous step's update; its sampling is queued once they are filled
    filling: bool = False  # its masks are being filled


class EngineCore:
    def __init__(self, config: EngineConfig, executor=None) -> None:
        self.config = config
        self.executor = executor if executor is not None else make_executor(config)  # another: for tests
        try:
            num_blocks = self._num_blocks()
            config.cache.num_blocks = num_blocks
            self.executor.initialize_kv_cache(num_blocks)
        except BaseException:
            self.shutdown()
            raise
        self.scheduler = Scheduler(config.scheduler, config.cache, num_blocks)
        spec = config.speculative_config
        self.draft_policy = DraftPolicy(spec)  # which requests get drafts (a proposer may be set without spec)
        if spec is not None and spec.method in MODEL_METHODS:  # the draft model / head runs where the target does
            config.speculative_proposer = self.executor
            self.scheduler.num_lookahead_tokens = spec.num_speculative_tokens  # blocks for the draft's KV writes
        self.in_flight: deque[Launched] = deque()  # the steps on the device, oldest first (async scheduling)
        self.launch_error: BaseException | None = None  # raised by the next step (see _step_async)
        pp_size = config.parallel.pipeline_parallel_size
        self.pipeline_depth = pp_size if pp_size > 1 and config.speculative_proposer is None else 0
        self.scheduler.pipeline_depth = self.pipeline_depth
        # stages with a proposer: synchronous steps (a stage's step samples only when the engine takes its result)
        self.async_steps = config.scheduler.async_scheduling and pp_size == 1
        self.scheduler.defer_masks = self.async_steps  # (pipelined: a constrained request waits for its token)
        if config.scheduler.async_scheduling and not self.async_steps:
            self.scheduler.drafts_enabled = True
        self.batch_queue: deque = deque()  # (scheduler output, future) of the steps in flight (pipelined)
        self.max_batches_in_flight = 0  # the most steps with tokens in flight at once so far (pipelined)
        logger.info("KV cache: %d blocks of %d tokens", num_blocks, config.cache.block_size)

    def _num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        memory = cache.kv_cache_memory_bytes
        if memory is None:  # on a GPU: profiled (raises when the model leaves no room); on CPU: a memory share
            memory = self.executor.available_kv_cache_bytes() or default_cpu_kv_cache_bytes()
        per_block = self.executor.kv_bytes_per_block()
        num_blocks = memory // per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={memory} holds no KV-cache block; one block needs {per_block} bytes"
            )
        return int(num_blocks)

    def shutdown(self) -> None:
        """Ends the executor's worker processes, if it has any (they also end with this process)."""
        shutdown = getattr(self.executor, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def add_request(self, request: Request) -> None:
        params = request.sampling_params
        if params is not None and params.logits_processors:  # callables stay in this process: the message has none
            self.executor.register_logits_processors(request.request_id, params.logits_processors)
        self.scheduler.add_request(request)

    def abort_requests(self, req_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self.scheduler.finish_requests(req_ids, status)

    def has_unfinished_requests(self) -> bool:
        in_flight = bool(self.in_flight or self.batch_queue) or self.launch_error is not None
        return in_flight or self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        if self.launch_error is not None:  # a launch that failed after the last step's update (_step_async)
            error, self.launch_error = self.launch_error, None
            raise error
        if self.pipeline_depth:
            return self._step_pipelined()
        if self.async_steps:
            self._queue_deferred_sampling()
            if not self._drafting():
                if self.config.speculative_proposer is not None:
                    self.scheduler.set_drafts({})  # drafts proposed by a synchronous step are dropped
                return self._step_async()
            self.scheduler.drafts_enabled = True  # a synchronous step: drafts may be verified (see _drafting)
            if self.in_flight:  # to synchronous steps with drafts: the steps on the device end first
                step, out = self._oldest_result()
                if not self.in_flight:
                    return self._update(step.so, out)
                try:  # (drafts follow the last step's tokens: proposed after its update)
                    return self.scheduler.update_from_output(step.so, out)
                finally:  # the masks of the step behind it follow its tokens
                    self._start_masks()
        if not self.scheduler.has_unfinished_requests():
            return []
        so = self.scheduler.schedule()
        if not so.num_scheduled_tokens:  # nothing runnable: maybe waiting for a grammar to compile
            self.scheduler.wait_for_grammars(_GRAMMAR_WAIT_S)
        try:
            out = self.executor.execute_model(so)
        except BaseException:
            self._discard(so)
            raise
        return self._update(so, out)

    def _update(self, so, out) -> list[EngineCoreOutput]:
        """A synchronous step's update, then the drafts for the next step."""
        outputs = self.scheduler.update_from_output(so, out)
        if so.scheduled_spec_decode_tokens:
            self.draft_policy.record(so.scheduled_spec_decode_tokens, out.sampled_token_ids)
        if self.config.speculative_proposer is not None:
            self._propose(self.config.speculative_proposer)
        return outputs

    def _drafting(self) -> bool:
        """With async scheduling: whether the next step is synchronous, with drafts (a proposer, and a batch within
        disable_by_batch_size: the running and waiting requests, up to max_num_seqs)."""
        if self.config.speculative_proposer is None:
            return False
        limit, sched = self.draft_policy.disable_by_batch_size, self.scheduler
        return limit is None or min(len(sched.running) + len(sched.waiting), sched.max_num_seqs) <= limit

    def _propose(self, proposer) -> None:
        """Drafts for the next step of the running requests that decode, as the policy allows
        (spec_decode/policy.py)."""
        chosen = self.draft_policy.select(self.scheduler.running)
        token_ids = {r.request_id: r.all_token_ids for r in chosen}
        self.scheduler.set_drafts(proposer.propose(token_ids) if token_ids else {})

    def _step_async(self) -> list[EngineCoreOutput]:
        """Waits for the oldest step N's tokens and updates from them, then schedules and launches N+2 (N+1 is on
        the device already): the host's work for N+2 and for N's outputs (returned, processed by the caller) overlaps
        the device running N+1. The first call launches two steps first. A request that step N ends (EOS, a stop
        token) has had one more token computed in N+1, which is dropped; one that the caller ends after N (a stop
        string, an abort) two. A step whose masks are deferred (a constrained request's last token was in the step
        before it) goes out as its forward alone: its masks are filled after that step's update, from the grammars
        that took its tokens, while the caller processes the outputs; the next call queues its sampling, then
        launches the next step behind it."""
        queue, sched = self.in_flight, self.scheduler
        while len(queue) < 2 and not (queue and queue[-1].masks_wait) and sched.has_unfinished_requests():
            if not self._launch_async().so.num_scheduled_tokens:
                break
        if not queue:
            return []
        oldest, out = self._oldest_result()
        try:
            outputs = sched.update_from_output(oldest.so, out)
        finally:  # the masks of the step behind it follow its tokens (also after a failure: its result needs them)
            masks_wait = self._start_masks()
        if not masks_wait and len(queue) < 2 and sched.has_unfinished_requests():
            try:
                self._launch_async()
            except BaseException as e:  # the caller takes N's outputs first; the next call raises
                self.launch_error = e
        return outputs

    def _oldest_result(self):
        """(the oldest step in flight, taken off the queue, and its result); a failed step ends its requests."""
        oldest = self.in_flight.popleft()
        try:
            return oldest, oldest.future.result()
        except BaseException:
            self._discard(oldest.so)
            self._start_masks()  # (the step behind it: its later result() needs its masks)
            raise

    def _launch_async(self) -> Launched:
        """Schedules a step and launches it behind the steps in flight."""
        so = self.scheduler.schedule()
        if not so.num_scheduled_tokens and not self.in_flight:
            self.scheduler.wait_for_grammars(_GRAMMAR_WAIT_S)
        try:
            step = Launched(so, self.executor.launch(so), getattr(so.grammar_bitmask, "deferred", False))
        except BaseException:
            self._discard(so)
            raise
        self.in_flight.append(step)
        return step

    def _start_masks(self) -> bool:
        """After a step's update: the masks of the step behind it, if deferred, start filling (on the filler's
        threads, while the caller processes the outputs); the next call queues its sampling. Returns whether."""
        step = self.in_flight[0] if self.in_flight else None
        if step is None or not step.masks_wait or step.filling:
            return False
        step.filling = self.scheduler.start_masks(step.so)
        return step.filling

    def _queue_deferred_sampling(self) -> None:
        step = self.in_flight[-1] if self.in_flight else None
        if step is not None and step.filling:
            step.masks_wait = step.filling = False
            try:
                step.future.sample()
            except BaseException:  # a failure ends the step's requests
                self.in_flight.pop()
                self._discard(step.so)
                raise

    def _step_pipelined(self) -> list[EngineCoreOutput]:
        """Launches one more step while fewer than pipeline_depth are in flight and one was scheduled (a step with
        nothing to run still goes out: it tells the runners which requests ended), else takes the oldest: its
        sampling queued, its batch's next step launched, then its tokens awaited and the scheduler updated."""
        queue = self.batch_queue
        if len(queue) < self.pipeline_depth and self.scheduler.has_unfinished_requests():
            so = self._launch_pipelined(idle=not queue)
            if so.num_scheduled_tokens and len(queue) < self.pipeline_depth:
                return []
        if not queue:
            return []
        so, future = queue.popleft()
        try:
            future.sample()  # (on a GPU queued on the device: the host goes on)
            self.scheduler.release_step(so.step_id)
            if self.scheduler.has_unfinished_requests():
                self._launch_pipelined(idle=False)  # the batch's next step, queued behind its sampling
            out = future.result()
        except BaseException:
            self._discard(so)
            raise
        return self.scheduler.update_from_output(so, out)

    def _launch_pipelined(self, idle: bool):
        """Schedules a step and launches it at the back of the queue; returns its scheduler output. idle: nothing
        else is in flight (a step with nothing to run then waits a little for a grammar being compiled)."""
        queue = self.batch_queue
        so = self.scheduler.schedule()
        if not so.num_scheduled_tokens and idle:
            self.scheduler.wait_for_grammars(_GRAMMAR_WAIT_S)
        try:
            queue.append((so, self.executor.launch(so)))
        except BaseException:
            self._discard(so)
            raise
        running = sum(1 for s, _ in queue if s.num_scheduled_tokens)
        self.max_batches_in_flight = max(self.max_batches_in_flight, running)
        return so

    def _discard(self, so) -> None:
        """The step's KV was not written: its requests end, and their blocks must not be found as a prefix."""
        self.scheduler.step_reqs.pop(so.step_id, None)
        self.scheduler.released.discard(so.step_id)
        self.scheduler.discard_requests(list(so.num_scheduled_tokens))

"""Executor: runs the model runner. UniProcExecutor: one rank, in the engine's process; several ranks: the
multiprocess or Ray executor of distributed/ (make_executor picks)."""

from __future__ import annotations

from collections.abc import Mapping

from pagedllm.config import EngineConfig
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.worker.step_future import StepFuture


def make_executor(config: EngineConfig):
    """The executor for the config's ranks and distributed_executor_backend."""
    if config.parallel.world_size == 1:  # one rank runs in the engine's process whatever the backend
        return UniProcExecutor(config)
    return ranks_executor(config)


def ranks_executor(config: EngineConfig):
    """The executor of several ranks (a RanksExecutor): Ray's or the multiprocess one."""
    p = config.parallel
    from pagedllm.distributed.ray_executor import RayExecutor, default_backend

    backend = p.distributed_executor_backend or default_backend(config)
    if backend == "ray":
        return RayExecutor(config)
    from pagedllm.distributed.mp_executor import MultiprocExecutor

    return MultiprocExecutor(config)


class UniProcExecutor:
    def __init__(self, config: EngineConfig) -> None:
        self.runner = ModelRunner(config)

    def kv_bytes_per_block(self) -> int:
        return self.runner.kv_bytes_per_block()

    def available_kv_cache_bytes(self) -> int | None:
        """On a GPU: the KV-cache budget found by profiling; None elsewhere."""
        return self.runner.available_kv_cache_bytes()

    def register_logits_processors(self, req_id: str, processors: list) -> None:
        """A request's logits processors: callables stay in this process, the step message carries none."""
        self.runner.register_logits_processors(req_id, processors)

    def add_lora(self, lora_request) -> bool:
        """Reads and checks a LoRA adapter (ValueError); False if it was known."""
        return self.runner.add_lora(lora_request)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)
        self.runner.capture_cudagraphs()  # graphs point at the cache, so they come after it

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def launch(self, scheduler_output: SchedulerOutput) -> StepFuture:
        """Queues the step on the device; the returned future's result() waits for it (async scheduling)."""
        return self.runner.launch(scheduler_output)

    def propose(self, token_ids: dict[str, list[int]]) -> Mapping[str, list[int]]:
        """Draft tokens from the runner's draft model or EAGLE head (a DeviceDrafts: spec_decode/device_drafts.py)."""
        return self.runner.drafter.propose(token_ids)

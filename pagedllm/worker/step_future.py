"""A launched step's sampled tokens (and logprobs) on their way from the device to the host and into the runner's
persistent batch."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.sample.logprobs import LogprobTensors
from pagedllm.sample.step_sampler import SamplerOutput
from pagedllm.spec_decode.device_drafts import DeviceDrafts
from pagedllm.worker.scheduler_output import ModelRunnerOutput

if TYPE_CHECKING:
    from pagedllm.worker.model_runner import ModelRunner


class StepFuture:
    """A launched step: its sampled ids stay on the device until result() copies them to the host (once)."""

    def __init__(
        self, runner, req_ids, rows, output: SamplerOutput, prompt_logprobs, drafts=None, device_drafts=None
    ) -> None:
        sampled, logprobs = output.sampled, output.logprobs
        self.runner: ModelRunner | None = runner
        self.req_ids: list[str] = req_ids  # the requests that sampled, in sampled order
        self.rows: np.ndarray = rows  # [num_sampled] their persistent-batch rows (a request's k + 1 with drafts)
        self.drafts: list[list[int]] | None = drafts  # per request the drafts it verifies (None: a step without)
        self.device_drafts: DeviceDrafts | None = device_drafts  # the values of placeholders (UNKNOWN) among them
        self.generations: list[int] = runner.batch.generation[rows].tolist()  # which admission held each row
        self.index_of_row = np.full(len(runner.batch.generation), -1, dtype=np.int64)  # [max_num_seqs] -1: none
        self.index_of_row[rows] = np.arange(len(rows))  # row -> its index in sampled
        self.sampled: torch.Tensor = sampled  # [num_sampled] on the device
        self.logprobs: LogprobTensors | None = logprobs
        self.prompt_logprobs: dict = prompt_logprobs
        self.committed = False
        self._output: ModelRunnerOutput | None = None
        self._host = sampled
        self._copied = self._pinned = None
        if runner.on_cuda:  # start the copies now; result() only waits for them
            if logprobs is None:
                (self._host,), self._pinned = runner.host_copies.copy(sampled)
            else:  # one copy where the sampling kernel wrote both into one buffer
                (self._host, packed), self._pinned = runner.host_copies.copy(sampled, logprobs.packed)
                self.logprobs = LogprobTensors(logprobs.num_top, packed)
            self._copied = torch.cuda.Event()
            self._copied.record()

    @classmethod
    def ready(cls, output: ModelRunnerOutput) -> StepFuture:
        step = cls.__new__(cls)
        step.committed, step._output = True, output
        return step

    def done(self) -> bool:
        """Whether result() would return without waiting for the device."""
        return self._output is not None or self._copied is None or self._copied.query()

    def sample(self) -> StepFuture:
        """Its tokens are sampled already (as a pipelined step's, distributed/pipeline.py)."""
        return self

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            if self._copied is not None:
                self._copied.synchronize()
            self._output = self.runner.commit(self, self._host.tolist())
            self.runner.host_copies.give_back(self._pinned)  # read into lists: the next copies may use it
            self.committed, self.runner, self._host, self._pinned, self.logprobs = True, None, None, None, None
        return self._output

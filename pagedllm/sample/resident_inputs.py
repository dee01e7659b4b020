"""The GPU sampling kernel's inputs kept on the device from step to step (pagedllm/kernels/sampling_inputs.py lays
them out): the parameters of every row of the persistent batch and the tokens of its penalized rows, which the kernel
advances itself as it samples (each row's position, a penalized row's token list). A step uploads only what changed:
when the step's rows differ from the last step's, the step's words (which logits row is which state row, the
penalized and logprobs places, the order of the programs), with a patch for each row that joined the batch (its
parameters and, if penalized, its tokens), which the kernel writes into the state. A batch that goes on as it was
costs no upload and a few comparisons on the host."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.device import Staging
from pagedllm.kernels.sampling_inputs import (
    GREEDY_BELOW,
    PARAMS,
    DeviceInputs,
    is_filtered,
    pack_params,
    step_words,
)
from pagedllm.sample.metadata import OutputBuffers, SamplingMetadata

MIN_TOKEN_CAP = 256  # token places per row when the first penalized row comes (then doubled as rows grow)


class ResidentInputs:
    """The kernel's state on the device and, on the host, what it holds once the launched kernels have run."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.state: torch.Tensor | None = None  # [rows * PARAMS + rows * token_cap] int32 on the device
        self.num_rows = 0
        self.token_cap = 0
        self.admission = np.zeros(0, dtype=np.int64)  # [rows] the admission whose parameters a row holds (0: none)
        self.generated = np.zeros(0, dtype=np.int64)  # [rows] its position (tokens generated) as the state holds it
        self.step: torch.Tensor | None = None  # the last step's words on the device
        self.step_rows: np.ndarray | None = None  # [batch] the last step's state rows
        self.num_pen = 0  # its penalized rows
        self.staging = Staging(self.device)
        self.outputs = OutputBuffers(self.device)  # where the kernel writes the tokens and logprobs
        self.inputs: DeviceInputs | None = None  # the last step's, over the state and step words above
        self.last: _Step | None = None  # the last step that ran the kernel

    def update(self, batch, rows: np.ndarray, num_tokens: np.ndarray) -> SamplingMetadata:
        """The metadata of a step that samples the persistent batch's rows (an InputBatch; rows [n] in logits
        order), num_tokens [n]: each request's tokens so far, one still on the device included (async scheduling).
        A penalized row's tokens are uploaded from the host when it joins the state (those the host holds)."""
        last = self.last
        if (
            last is not None
            and len(rows) == len(last.rows)
            and np.array_equal(num_tokens, last.num_tokens + 1)
            and np.array_equal(rows, last.rows)
            and np.array_equal(batch.generation[rows], last.admission)
        ):  # the batch goes on as it was: the state holds every row as the last step's kernel advanced it
            return self._goes_on(batch, last, num_tokens)
        self.last = None
        sampling = batch.temperature[rows] >= GREEDY_BELOW
        num_top = batch.num_logprobs[rows]
        penalized, wanted = batch.penalized[rows], num_top >= 0
        if not (sampling.any() or penalized.any() or wanted.any()):
            return SamplingMetadata.over_device_inputs(sampling, None, None, self.device)  # torch's argmax: no inputs
        if self.state is None or self.num_rows != len(batch.temperature):
            self._allocate(len(batch.temperature))
        generated = num_tokens - batch.num_prompt[rows]
        admission = batch.generation[rows]
        stale = (self.admission[rows] != admission) | (self.generated[rows] != generated)
        need = int(num_tokens[penalized].max()) + 1 if penalized.any() else 0  # the token this step appends
        self._room(batch, need)
        same = self.step_rows is not None and len(rows) == len(self.step_rows) and (rows == self.step_rows).all()
        if not same or stale.any():
            self._upload(batch, rows, num_tokens, stale, sampling, penalized, wanted)
        self.admission[rows] = admission
        self.generated[rows] = generated + 1  # the kernel advances every row it samples
        self.last = _Step(rows.copy(), admission, num_tokens.copy(), sampling, num_top, need)
        return self._metadata(self.last)

    def _goes_on(self, batch, last: _Step, num_tokens: np.ndarray) -> SamplingMetadata:
        """The metadata of a step over the last step's rows, each one token further: the state and the step's words
        on the device hold it already (the patches were written, the kernel advanced every row)."""
        self.generated[last.rows] += 1
        last.num_tokens = num_tokens.copy()
        if last.need:
            last.need += 1
            self._room(batch, last.need)
        return self._metadata(last)

    def _metadata(self, step: _Step) -> SamplingMetadata:
        inputs = self.inputs
        if inputs is None or inputs.state is not self.state or inputs.step is not self.step:
            inputs = self.inputs = DeviceInputs(
                self.state, self.step, self.num_rows, self.token_cap, self.num_pen, advance=True
            )  # fmt: skip
        return SamplingMetadata.over_device_inputs(step.sampling, inputs, step.num_top, self.device, self.outputs)

    def holds(self, rows: np.ndarray, admission: np.ndarray) -> np.ndarray:
        """Whether the state holds these rows of the persistent batch as admitted (admission [rows]: InputBatch's
        generation), tokens included where penalized: then the step needs none of them from the host. [rows] bool"""
        if len(self.admission) == 0:
            return np.zeros(len(rows), dtype=bool)
        return self.admission[rows] == admission

    def _allocate(self, num_rows: int) -> None:
        self.num_rows, self.token_cap = num_rows, 0
        self.state = torch.zeros(num_rows * PARAMS, dtype=torch.int32, device=self.device)
        self.admission = np.zeros(num_rows, dtype=np.int64)
        self.generated = np.full(num_rows, -1, dtype=np.int64)
        self.step = self.step_rows = self.last = None

    def _room(self, batch, need: int) -> None:
        """Room for need tokens per row (at most the longest a request of the batch gets), copied on the device."""
        if need <= self.token_cap:
            return
        most = batch.token_ids.shape[1]
        cap = min(max(MIN_TOKEN_CAP, 1 << (need - 1).bit_length()), max(most, need))
        rows, at = self.num_rows, self.num_rows * PARAMS
        state = torch.zeros(at + rows * cap, dtype=torch.int32, device=self.device)
        state[:at] = self.state[:at]
        if self.token_cap:
            state[at:].view(rows, cap)[:, : self.token_cap] = self.state[at:].view(rows, self.token_cap)
        self.state, self.token_cap = state, cap

    def _upload(self, batch, rows, num_tokens, stale, sampling, penalized, wanted) -> None:
        """The step's words, with a patch for each stale row (its parameters and, if penalized, its tokens), in one
        host-to-device copy; the kernel writes the patches into the state."""
        fresh = rows[stale]
        pen = penalized[stale]
        # a penalized row goes up when it joins the state (a new admission: the runner has waited for the host's
        # tokens); it is never stale by position alone, since every step that samples it runs the kernel
        lengths = np.where(pen, np.minimum(num_tokens[stale], batch.num_tokens[fresh]), 0)  # the tokens the host holds
        params = pack_params(
            batch.temperature[fresh], batch.top_k[fresh], batch.top_p[fresh], batch.min_p[fresh],
            batch.seed[fresh], batch.has_seed[fresh] & sampling[stale], num_tokens[stale] - batch.num_prompt[fresh],
            batch.num_prompt[fresh], lengths, batch.repetition_penalty[fresh], batch.presence_penalty[fresh],
            batch.frequency_penalty[fresh],
        )  # fmt: skip
        tokens = batch.token_ids[fresh, : int(lengths.max(initial=0))]
        filtered = is_filtered(batch.top_k[rows], batch.top_p[rows], batch.min_p[rows])
        words = step_words(rows, sampling, filtered, penalized, wanted, stale, params, tokens)
        self.step = self.staging.upload(words)
        self.step_rows, self.num_pen = rows.copy(), int(penalized.sum())


@dataclass
class _Step:
    """What the last step that ran the kernel sampled: its rows [n], their admissions [n] and tokens [n] (a late one
    included), which draw [n] bool, the top logprobs each wants [n], and the tokens its penalized rows need room for
    (0: none penalized)."""

    rows: np.ndarray
    admission: np.ndarray
    num_tokens: np.ndarray
    sampling: np.ndarray
    num_top: np.ndarray
    need: int

"""The sampler as the model runner calls it, twice a step: prepare() before the forward (the step's rows; every
host-to-device upload of the sampler's inputs happens there, so it precedes the forward on the device's queue) and
sample() after it (the logits in, a SamplerOutput out). Everything between the logits and the sampled tokens lives
behind it: allowed-token bitmasks, logit adjustments, penalties, the sampling rules and the logprobs, in the
implementation (Triton / C / torch, pagedllm/sample/impl.py) chosen once when it is built.

A row's parameters are its record in the runner's persistent batch (InputBatch: the request's SamplingParams, kept
as per-row columns when it joins, and its logits processors, which never leave the engine's process)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.kernels.sampling_inputs import GREEDY_BELOW
from pagedllm.sample.adjust import adjust_logits, adjusted_rows, penalties
from pagedllm.sample.bitmask import Bitmask, apply_bitmask, per_position, stack_bitmasks
from pagedllm.sample.impl import TRITON, C, choose_impl
from pagedllm.sample.logprobs import LogprobTensors, logprob_rows, logprob_tensors, sampled_logprobs
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler
from pagedllm.sample.verify import expand_rows

if TYPE_CHECKING:  # the runner's persistent batch: the sampler reads its rows
    from pagedllm.sample.custom_batch import CustomLogitsProcessors
    from pagedllm.worker.input_batch import InputBatch


@dataclass
class SamplingStep:
    """One step's sampling, as prepare() left it for sample()."""

    rows: np.ndarray  # [n] the persistent batch's rows, in logits order
    num_tokens: np.ndarray  # [n] each request's tokens so far, one still on the device included (async scheduling)
    meta: SamplingMetadata
    num_top: np.ndarray  # [n] top logprobs each row wants (-1: none)
    bitmask: Bitmask | None  # the masked rows' allowed tokens (None: no row has a mask)
    adjusted: np.ndarray | None = None  # [n] bool: rows whose logits change before the logprobs read them


@dataclass
class SamplerOutput:
    sampled: torch.Tensor  # [n] int64 on the logits' device
    logprobs: LogprobTensors | None  # the sampled tokens' logprobs, where rows want them


class StepSampler:
    def __init__(
        self, batch: InputBatch, device: torch.device, seed: int, custom: CustomLogitsProcessors | None = None
    ) -> None:
        self.batch = batch
        self.custom = custom  # the engine-wide logits processor classes' instances (None: none)
        self.device = torch.device(device)
        self.impl = choose_impl(self.device)
        self.rules = Sampler(self.device, seed, self.impl)
        self.resident = self.rules.resident  # the GPU kernel's inputs kept on the device (Triton only)
        self.scratch = self.rules.c_scratch  # the C kernels' working rows (also lent to the logprobs)

    def reads_outputs(self, rows: np.ndarray) -> np.ndarray:
        """Which of these rows read their output tokens on the host this step: bad words and logits processors;
        penalties, except where the GPU kernel keeps the row's tokens on the device already (it appends each token
        it samples; the tokens go there when the request joins). [rows] bool"""
        b, resident = self.batch, self.resident
        if resident is None:
            return b.reads_outputs[rows] | b.penalized[rows]
        return b.reads_outputs[rows] | (b.penalized[rows] & ~resident.holds(rows, b.generation[rows]))

    def prepare(
        self,
        rows: np.ndarray,
        num_tokens: np.ndarray,
        bitmasks: list[np.ndarray | None] | None = None,
        num_drafts: np.ndarray | None = None,
    ) -> SamplingStep:
        """Before the forward: the sampler's inputs for these rows (rows [n] of the persistent batch, in logits
        order; num_tokens [n]; bitmasks: per row a packed allowed-token mask or None), uploaded now. num_drafts [n]:
        the drafts each row verifies (None: none); a row with k of them samples at k + 1 positions, in order
        (sample/verify.py), each under its own mask (a masked row's is [k + 1, words]), and the step's inputs are
        built for it alone."""
        b = self.batch
        if self.custom is not None:  # (no drafts: refused with them) their batch is these rows, in this order
            self.custom.update(b, rows)
        if num_drafts is not None:
            if bitmasks is not None:
                bitmasks = per_position(bitmasks, num_drafts)
            rows, num_tokens = expand_rows(rows, num_tokens, num_drafts)
        if self.resident is not None and num_drafts is not None:
            self.resident.last = None  # the kernel's resident inputs advance one position per row: rebuilt next
        if self.resident is not None and num_drafts is None:
            meta = self.resident.update(b, rows, num_tokens)
        else:  # a draft position's penalties count the drafts before it
            pens = penalties(b, rows, num_tokens if num_drafts is not None else None)
            meta = SamplingMetadata.build(
                b.temperature[rows], b.top_k[rows], b.top_p[rows], b.min_p[rows],
                seeds=b.seed[rows], seeded=b.has_seed[rows], positions=num_tokens - b.num_prompt[rows],
                device=self.device, penalties=pens, num_top=b.num_logprobs[rows], impl=self.impl,
            )  # fmt: skip
        bitmask = stack_bitmasks(bitmasks, self.impl, self.device) if bitmasks else None
        return SamplingStep(rows, num_tokens, meta, b.num_logprobs[rows], bitmask)

    def needs_float32(self, step: SamplingStep) -> bool:
        """Whether the step's logits must be float32. They may stay in the model's dtype when no row adjusts its
        logits, is penalized, is masked or wants logprobs: on CUDA, where torch's argmax and the sampling kernel
        read any float dtype exactly; on the CPU when every row takes the argmax (the C argmax reads bfloat16
        exactly)."""
        meta = step.meta
        step.adjusted = adjusted_rows(self.batch, step.rows, step.num_tokens, meta)
        if self.impl == TRITON:
            readers = meta.all_greedy or meta.device_inputs is not None  # torch's argmax, the sampling kernel
        elif self.impl == C:
            readers = meta.all_greedy and meta.params is not None  # the C kernels' argmax
        else:
            readers = meta.all_greedy and self.rules.on_cuda  # torch's argmax
        as_is = (
            readers
            and step.bitmask is None
            and meta.penalties is None
            and not (step.num_top >= 0).any()
            and not step.adjusted.any()
            and not (meta.device_inputs is not None and meta.device_inputs.num_pen)
        )
        return not as_is

    def sample(self, logits: torch.Tensor, step: SamplingStep) -> SamplerOutput:
        """After the forward: logits [n, vocab] (changed in place) -> the sampled tokens and their logprobs."""
        if step.adjusted is None:
            step.adjusted = adjusted_rows(self.batch, step.rows, step.num_tokens, step.meta)
        if step.bitmask is not None:  # before anything reads the logits
            apply_bitmask(logits, step.bitmask, self.impl)
        lp_rows = logprob_rows(logits, step.num_top, step.adjusted, self.scratch, self.impl)  # before they change
        logits = adjust_logits(self.batch, step.rows, step.num_tokens, logits)
        if self.custom is not None:  # after the requests' own adjustments, before the penalties (vLLM's order)
            logits = self.custom.apply(logits, not (self.batch.temperature[step.rows] >= GREEDY_BELOW).any())
        sampled = self.rules(logits, step.meta, lp_rows.copied if lp_rows is not None else None)  # [n]
        logprobs = logprob_tensors(lp_rows, sampled, step.num_top, self.scratch, step.meta, self.impl)
        return SamplerOutput(sampled, logprobs)

    def token_logprobs(self, logits: torch.Tensor, targets: torch.Tensor, num_top: np.ndarray) -> list:
        """The logprobs of given tokens (prompt logprobs): logits [n, vocab] float32, targets [n], num_top [n] ->
        per row (token ids, logprobs, ranks), the target first, then its top-k."""
        rows = logprob_rows(logits, num_top, np.zeros(len(num_top), dtype=bool), impl=self.impl)  # nothing adjusts
        return sampled_logprobs(rows, targets, num_top, self.scratch, impl=self.impl)

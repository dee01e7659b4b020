"""Pipeline parallelism: the decoder's layers are split into pp_size stages (layers/build_context.stage_layers:
equal parts, the first num_layers % pp_size stages one layer more), each stage a tensor-parallel group of ranks. The
engine keeps up to pp_size steps in flight, on disjoint batches (a request with a step in flight is not scheduled
again), so that stage s runs step k + 1 while the stages after it run step k.

A step on each stage (every rank runs its steps in the order the engine launched them):
- stage 0, when launched: embed and run its layers, send (hidden, residual) to stage 1, and post the receive of the
  step's final hidden states from the last stage; it returns at once (a PendingStep).
- stage s > 0, when launched: receive from stage s - 1, run its layers, send to stage s + 1; the last stage sends the
  final hidden states (after the norm) to stage 0.
- stage 0, when the engine samples the step (sample(), the oldest step in flight): wait for that receive, compute
  the logits (the stage's tensor-parallel ranks gather them; the engine tells the driver's peers to, in the driver's
  order), and the driver samples; the sampled tokens go to the stage's other ranks by a broadcast in its
  tensor-parallel group. On a GPU all of it is queued on the stream: the host does not wait. The engine then
  schedules and launches the same batch's next step, whose input tokens are the sampled ones still on the device
  (as async scheduling on one GPU), and only then waits for the tokens (result()): the host's work for the batch
  (its update, the next schedule, the inputs) runs while the device computes, and the sampling of step k is
  followed on stage 0's stream by the forward of step k + pp_size with no gap. The later stages never need the
  token ids (their inputs are hidden states; positions and slots come with the step).

The order of sends and receives: on each pair of ranks, messages go one way per group, in step order on both sides:
activations stage s -> s + 1 in the `pp` group, final hidden states last -> 0 in the `pp_back` group. Sends are
asynchronous (a stage waits for its send of step k - pp_size only, which its peer received long before: each stage
takes its steps in order and the first stage posts each return receive when it launches the step); receives block.
So no rank ever waits for a peer that waits for it, on gloo (blocking host calls) as on NCCL (stream-ordered, one
stream per group), and the two directions never share a channel.

Every stage knows the step's token count from the scheduler output, so the tensors' shapes need no message of their
own: (hidden, residual) [2, num_tokens, hidden_size] between stages (models/stages.py), the final hidden states
[num_tokens, head_size] back (the LM head's input: hidden_size, or OPT's word_embed_proj_dim after its last stage's
project_out).

Decode steps replay each stage's CUDA graphs (run_graph; worker/cuda_graphs.py): a stage after the first takes the
received (hidden, residual) as the graph's static input, the sends and receives stay outside the graphs. Prefill and
mixed steps run eagerly, as on one GPU."""

from __future__ import annotations

from collections import deque

import torch
from torch import nn

from pagedllm.distributed.parallel_state import ParallelGroups
from pagedllm.layers.build_context import stage_layers
from pagedllm.worker.scheduler_output import ModelRunnerOutput, SchedulerOutput


class Received:
    """A posted receive: its tensor is valid after wait(). aux: EAGLE-3's layer copies from the later stages, each
    (its receive, its columns of the buffer, the buffer's rows), put into the first stage's buffer by wait()."""

    def __init__(self, work, tensor: torch.Tensor, aux: list | None = None) -> None:
        self.work, self.tensor, self.aux = work, tensor, aux

    def done(self) -> bool:
        """Whether wait() would not block; always on the CPU (a gloo receive completes only in its wait, which
        raises within the group's timeout when the peer is gone)."""
        return self.work is None or self.tensor.device.type == "cpu" or self.work.is_completed()

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        for received, columns, rows in self.aux or ():
            rows[:, columns] = received.wait()[:, columns]
        self.aux = None
        return self.tensor


class PipelineStage:
    """One rank's place in the pipeline: runs its layers on what the previous stage sent and sends the result on."""

    def __init__(self, groups: ParallelGroups, hidden_size: int, dtype: torch.dtype, head_size: int | None = None):
        self.pp, self.back = groups.pp, groups.pp_back
        self.hidden_size, self.dtype = hidden_size, dtype
        self.head_size = hidden_size if head_size is None else head_size  # the final hidden states' width
        self.sends: deque = deque()  # (work, tensor) of the sends not waited for yet, oldest first
        self.aux: AuxLayers | None = None  # EAGLE-3's layer copies, when its head reads the target (hook_aux_layers)

    @classmethod
    def of(cls, groups: ParallelGroups, model_config) -> PipelineStage | None:
        """The rank's stage, None with one stage."""
        if groups.info.pp_size == 1:
            return None
        from pagedllm.models.registry import get_model_class

        hf_config = model_config.hf_config
        head_size = getattr(get_model_class(model_config.architecture, model_config.model_impl), "head_size", None)
        return cls(groups, hf_config.hidden_size, model_config.dtype, head_size(hf_config) if head_size else None)

    @property
    def is_first(self) -> bool:
        return self.pp.is_first

    def graph_input(self) -> tuple[int, torch.dtype] | None:
        """(hidden size, dtype) of the (hidden, residual) the stage's CUDA graphs take as a static input; None on
        the first stage (it takes token ids)."""
        return None if self.pp.is_first else (self.hidden_size, self.dtype)

    def run(self, model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, mm=None) -> Received | None:
        """This stage's layers over the step's tokens (inside its forward context), sent on. Returns on the first
        stage the posted receive of the final hidden states [num_tokens, head_size], None on the others. mm: the
        step's image embeddings (a vision-language model's first stage), or on a later stage the spans of images
        whose tokens attend both ways (Gemma 3; multimodal/encoder_runner.py)."""

        def forward(pair: torch.Tensor | None):
            if pair is not None:
                intermediate = (pair[0], pair[1])
                return model(None, positions, intermediate) if mm is None else model(None, positions, intermediate, mm)
            return model(input_ids, positions) if mm is None else model(input_ids, positions, mm_embeds=mm)

        return self._run(forward, positions.shape[-1], positions.device, positions.shape[-1])

    def run_graph(self, graphs, bs: int, num_tokens: int) -> Received | None:
        """As run, the layers replayed from the CUDA graph of size bs (worker/cuda_graphs.py, its inputs loaded):
        what the previous stage sent goes into the graph's static input; the last stage sends a copy of its static
        output (the next replay overwrites it; a stage before the last sends a stacked copy anyway)."""

        def forward(pair: torch.Tensor | None):
            if pair is not None:
                graphs.load_intermediate(bs, pair)
            out = graphs.replay(bs, num_tokens)  # [num_tokens, hidden], or (hidden, residual) before the last stage
            return out.clone() if self.pp.is_last else out

        return self._run(forward, num_tokens, graphs.device, bs * graphs.q_len)

    def _run(self, forward, n: int, device: torch.device, rows: int) -> Received | None:
        """Receives the previous stage's (hidden, residual) [2, n, hidden_size] (None on the first stage), runs
        forward on them and sends its result on; the first stage posts the receive of the final hidden states. With
        EAGLE-3 the stages after the first also send the first `rows` rows of their layer copies to the first stage
        (the rows the forward wrote: a verify graph's padded ones)."""
        pair = None
        if not self.pp.is_first:
            pair = torch.empty((2, n, self.hidden_size), dtype=self.dtype, device=device)
            self.pp.recv(pair, self.pp.rank - 1)
        out = forward(pair)
        if self.pp.is_last:
            self._send(self.back, out.contiguous(), 0)
        else:
            self._send(self.pp, torch.stack(out), self.pp.rank + 1)
        if self.aux is not None and self.pp.rank in self.aux.later_columns:
            self._send(self.back, self.aux.buffer[:rows].clone(), 0)
        if not self.pp.is_first:
            return None
        final = torch.empty((n, self.head_size), dtype=self.dtype, device=device)
        received = Received(self.back.irecv(final, self.back.size - 1), final)
        if self.aux is not None:
            received.aux = [(self._recv_aux(stage, rows), columns, self.aux.buffer[:rows])
                            for stage, columns in self.aux.later_columns.items()]  # fmt: skip
        return received

    def _recv_aux(self, stage: int, rows: int) -> Received:
        buffer = self.aux.buffer
        tensor = torch.empty((rows, buffer.shape[1]), dtype=buffer.dtype, device=buffer.device)
        return Received(self.back.irecv(tensor, stage), tensor)

    def _send(self, comm, x: torch.Tensor, dst: int) -> None:
        self.sends.append((comm.isend(x, dst), x))
        while len(self.sends) > self.pp.size:  # the send of pp_size steps ago: received by now (see the docstring)
            self.sends.popleft()[0].wait()


class AuxLayers:
    """EAGLE-3's copies of the target's layers with pipeline stages: each stage's decoder writes the columns of
    its own layers into its buffer [max tokens, 3 * hidden]; the first stage takes the later stages' columns."""

    def __init__(self, buffer: torch.Tensor, layer_ids: tuple[int, ...], num_layers: int, pp_size: int) -> None:
        self.buffer = buffer
        h = buffer.shape[1] // len(layer_ids)
        self.later_columns: dict[int, torch.Tensor] = {}  # later stage -> the buffer's columns it fills
        for stage in range(1, pp_size):
            first, last = stage_layers(num_layers, pp_size, stage)
            slots = [j for j, i in enumerate(layer_ids) if first <= i < last]
            if slots:
                cols = torch.cat([torch.arange(j * h, (j + 1) * h) for j in slots]).to(buffer.device)
                self.later_columns[stage] = cols


def pipeline_step(runner, so: SchedulerOutput):
    """A step on a pipeline stage, the runner's batch updated. A later stage runs its layers and sends on (its
    inputs are hidden states: no token ids, no sampling; returns a finished step); the first stage launches its
    layers (input tokens that the previous step of the batch sampled are taken on the device) and returns a
    PendingStep."""
    if not runner.stage.is_first:
        runner._run_model(runner._prepare_inputs(so), None)
        return Finished(ModelRunnerOutput({}))
    plan = runner.plan_step(so)
    final = runner._run_model(plan.flat, plan.late if plan.spec else runner._late_inputs(plan.flat))
    return PendingStep(runner, plan, final)


class Finished:
    """A step with nothing left to do."""

    def __init__(self, output: ModelRunnerOutput) -> None:
        self.output = output

    def done(self) -> bool:
        return True

    def sample(self) -> None:
        """(Nothing to sample.)"""

    def result(self) -> ModelRunnerOutput:
        return self.output


class PendingStep:
    """A step launched on the first stage (or, with one stage, a step whose grammar masks are deferred: its hidden
    states a Received with no work; worker/model_runner.py). sample(): the final hidden states received, the logits
    computed and the tokens sampled (by the driver; its tensor-parallel peers gather the logits and receive the
    tokens), queued on the device: a StepFuture, whose tokens the runner's next launch may take as inputs on the
    device. result(): its tokens on the host (sampling first if not done). done(): whether result() would not wait."""

    def __init__(self, runner, plan, final: Received) -> None:
        self.runner, self.plan, self.final = runner, plan, final
        self.sampled = None  # the StepFuture once sampled

    def done(self) -> bool:
        return self.sampled.done() if self.sampled is not None else self.final.done()

    def sample(self):
        if self.sampled is None:
            hidden = self.final.wait()  # [num_tokens, hidden] (on a GPU: the stream waits, not the host)
            with torch.inference_mode():
                runner, plan = self.runner, self.plan
                self.sampled = runner.finish_step(plan, hidden, runner.prepare_sampling(plan))
            self.runner = self.plan = self.final = None
        return self.sampled

    def result(self) -> ModelRunnerOutput:
        return self.sample().result()

"""One forward through the pipeline stages: each stage runs its layers on what the previous one sent, and the last
stage sends the final hidden states back to the first, which computes the logits (and whose driver rank samples).

Every stage knows the step's token count from the scheduler output, so the tensors' shapes need no message of
their own: (hidden, residual) [2, num_tokens, hidden_size] between stages, hidden [num_tokens, hidden_size] back."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed.communicator import Communicator


def pipeline_forward(
    model: nn.Module,
    pp: Communicator,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    hidden_size: int,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """hidden [num_tokens, hidden_size] on the first stage, None on the others."""
    n, device = positions.shape[0], positions.device
    if pp.is_first:
        out = model(input_ids, positions)
    else:
        pair = pp.recv(torch.empty((2, n, hidden_size), dtype=dtype, device=device), pp.rank - 1)
        out = model(None, positions, (pair[0], pair[1]))
    if pp.is_last:
        pp.send(out, 0)
        return None
    pp.send(torch.stack(out), pp.rank + 1)
    if not pp.is_first:
        return None
    return pp.recv(torch.empty((n, hidden_size), dtype=dtype, device=device), pp.size - 1)

"""A decoder's pipeline stages (distributed/pipeline.py): each stage builds only its own layers (the others are
MissingLayer placeholders without weights, so checkpoint names keep their indices and load_weights skips theirs),
the first stage also the parts before the layers (token and position embeddings, an embedding norm or projection),
the last the parts after them (final norm, output projection).

What crosses from one stage to the next is a pair (hidden, residual) [2, num_tokens, hidden_size], whose sum is the
residual stream there. A family whose pre-norm blocks keep the residual apart, to add it in the next norm (Llama,
GPT-2, MPT), sends the two as they are; a family whose blocks return the stream itself (GPT-J, GPT-NeoX, Phi,
Falcon, BLOOM, OPT) sends (stream, zeros), and its next stage takes the stream (`stream_of`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagedllm.layers.build_context import current_build_context, stage_layers
from pagedllm.models.utils import MissingLayer


def build_stage(decoder: nn.Module, num_layers: int, make_layer: Callable[[int], nn.Module]) -> nn.ModuleList:
    """The decoder's layers on this rank's stage: make_layer(i) for the stage's, MissingLayer for the others'. Sets
    decoder.first, decoder.last (the stage's layers [first, last)), decoder.is_first_stage, decoder.is_last_stage."""
    context = current_build_context()
    decoder.first, decoder.last = stage_layers(num_layers, context.pp_size, context.pp_rank)
    decoder.is_first_stage, decoder.is_last_stage = context.pp_rank == 0, context.pp_rank == context.pp_size - 1
    return nn.ModuleList(
        make_layer(i) if decoder.first <= i < decoder.last else MissingLayer() for i in range(num_layers)
    )


def drop_other_stages(decoder: nn.Module, first: tuple[str, ...] = (), last: tuple[str, ...] = ()) -> None:
    """Replaces the decoder's parts that only the first stage runs (attribute names `first`) on the other stages,
    and those only the last runs (`last`) on the others, by MissingLayer (parts set to None stay None). Call after
    build_stage. (A tied LM head, on the first stage, shares the first stage's embedding.)"""
    for names, keep in ((first, decoder.is_first_stage), (last, decoder.is_last_stage)):
        for name in names if not keep else ():
            if getattr(decoder, name) is not None:
                setattr(decoder, name, MissingLayer())


def to_next_stage(x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The pair a stage before the last returns: (x, residual), or (stream, zeros) for a family without a residual
    apart."""
    return x, torch.zeros_like(x) if residual is None else residual


def stream_of(intermediate: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The residual stream in a pair that a family without a residual apart sent (to_next_stage(stream))."""
    return intermediate[0]

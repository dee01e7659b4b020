"""Prompts given as input embeddings, the runner's side: which rows of a step's flat batch take the user's
embeddings instead of the embedding of their (placeholder) token ids, and the model forward that feeds them.

Only a step with a prompt chunk of such a request pays anything: a row's embeddings leave the persistent batch
once its prompt is computed (a preempted request brings them back with its re-admission), so token-only and decode
steps see an empty dict. Such a step runs eagerly; decode steps (generated tokens are ids) keep their CUDA graphs."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.device import to_device


def step_embeds(batch, flat, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows of the flat batch [n], their embeddings [n, hidden] in dtype) of the step's prompt positions whose
    request gave embeddings; None when the step has none."""
    index = np.flatnonzero(np.isin(flat.rows, np.fromiter(batch.prompt_embeds, dtype=np.int64)))
    rows, values = [], []
    for i in index.tolist():
        row = int(flat.rows[i])
        embeds = batch.prompt_embeds[row]
        first, end_row = int(flat.query_start_loc[i]), int(flat.query_start_loc[i + 1])
        seq_len = int(flat.seq_lens[i])
        start, end = seq_len - (end_row - first), min(seq_len, len(embeds))  # positions [start, end) of the prompt
        if end > start:
            rows.append(np.arange(first, first + end - start))
            values.append(embeds[start:end])
        if seq_len >= len(embeds):  # its prompt is computed: later steps of the row are tokens only
            del batch.prompt_embeds[row]
    if not rows:
        return None
    return to_device(np.concatenate(rows), device), torch.cat(values).to(device=device, dtype=dtype)


def forward_with_prompt_embeds(model, input_ids: torch.Tensor, positions: torch.Tensor, embeds) -> torch.Tensor:
    """The model over the step's tokens with the rows embeds[0] of its input embeddings replaced by the user's
    embeds[1], through the decoder's `embed_inputs` (the scaling a family applies to HF's inputs_embeds)."""
    decoder = getattr(model, model.model_attr)
    x = decoder.embed(input_ids)  # [num_tokens, hidden]
    x = x.index_copy(0, embeds[0], decoder.embed_inputs(embeds[1].to(x.dtype)))
    return decoder(input_ids, positions, inputs_embeds=x)

"""/v1/completions' `prompt_embeds` (vLLM's field): base64 of a `torch.save`d tensor [seq_len, hidden] each, read
with torch's weights-only loader; the server must run with --enable-prompt-embeds. They come before the request's
text / token prompts in its choices, as vLLM's do."""

from __future__ import annotations

import base64
import binascii
import io
import math
import pickle

import torch

from pagedllm.entrypoints.openai.serving_utils import bad
from pagedllm.prompt_embeds import EmbedsPair, check_embeds

MAX_SPARSE_ELEMENTS = 1 << 26  # a sparse prompt_embeds' dense size (256 MiB of float32); any real prompt is far less


def decode_prompt_embeds(given, enabled: bool) -> list[torch.Tensor]:
    """The request's prompt_embeds (one base64 string or a list of them) as tensors; 400 where they cannot be read."""
    if given is None:
        return []
    if not enabled:
        raise bad("prompt_embeds: the server must be started with --enable-prompt-embeds", "prompt_embeds")
    items = [given] if isinstance(given, str) else list(given)
    if not items:
        raise bad("prompt_embeds is empty: give at least one base64-encoded tensor", "prompt_embeds")
    tensors = []
    for i, item in enumerate(items):
        try:  # a sparse tensor's indices are checked against its shape (else to_dense would write out of bounds)
            with torch.sparse.check_sparse_tensor_invariants():
                tensor = torch.load(io.BytesIO(base64.b64decode(item, validate=True)), weights_only=True,
                                    map_location="cpu")  # fmt: skip
        except (binascii.Error, pickle.UnpicklingError, ValueError, RuntimeError, EOFError, TypeError) as e:
            message = f"prompt_embeds[{i}]: not a base64-encoded torch.save of a tensor ({type(e).__name__})"
            raise bad(message, "prompt_embeds") from None
        if isinstance(tensor, torch.Tensor) and tensor.layout != torch.strided:
            if tensor.dim() not in (2, 3) or math.prod(tensor.shape) > MAX_SPARSE_ELEMENTS:  # before allocating it
                message = f"prompt_embeds[{i}]: a sparse tensor of shape {list(tensor.shape)}: at most "
                raise bad(message + f"{MAX_SPARSE_ELEMENTS} elements in 2 or 3 dimensions", "prompt_embeds")
            tensor = tensor.to_dense()
        tensors.append(tensor)
    return tensors


def embeds_pairs(tensors: list[torch.Tensor], hidden_size: int, truncate: int | None, max_model_len: int) -> list:
    """One EmbedsPair per tensor, each checked as the offline prompts are (ValueError: a 400 naming the prompt)."""
    return [EmbedsPair(check_embeds(t, hidden_size, truncate, max_model_len)) for t in tensors]

"""One multimodal item of a prompt after processing: its tensors, its hash and where its placeholder tokens are."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class MultiModalFeature:
    modality: str  # "image" or "video"
    identifier: str  # hex digest of the item's content and the processor options: the encoder cache key
    offset: int  # position of the item's first placeholder token in the prompt
    length: int  # number of placeholder tokens the encoder output fills
    data: dict[str, torch.Tensor]  # the processor's tensors for this item alone, e.g. pixel_values [1, 3, H, W]
    # M-RoPE models (Qwen2-VL): the item's (t, h, w) grid of LM tokens and the temporal position step per t
    grid: tuple[int, int, int] | None = field(default=None)
    time_interval: float = 1.0
    # its placeholder tokens attend to each other both ways in prefill (Gemma 3): no prefill chunk ends inside it
    bidirectional: bool = False

    @property
    def end(self) -> int:
        return self.offset + self.length

    def __getstate__(self) -> dict:
        """Pickled (the step message to the other tensor-parallel ranks) with its tensors as numpy arrays: plain
        data, each only its own elements (a tensor pickles the whole storage it views: an item cut from a batch of
        images would carry the batch)."""
        state = self.__dict__.copy()
        state["data"] = {k: _plain(v) for k, v in self.data.items()}
        return state

    def __setstate__(self, state: dict) -> None:
        state["data"] = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in state["data"].items()}
        self.__dict__.update(state)


def _plain(value):
    """A CPU tensor as a numpy array; one numpy cannot hold (bfloat16) as a compact copy of its own."""
    if not isinstance(value, torch.Tensor):
        return value
    value = value.detach().cpu()
    try:
        return value.numpy()
    except TypeError:
        return value.clone()


class ProcessedPrompt(dict):
    """A TokensPrompt ({"prompt", "prompt_token_ids"}) whose images were already processed (a chat conversation's):
    it carries their MultiModalFeatures."""

    def __init__(self, text: str | None, token_ids: list[int], mm_features: list[MultiModalFeature]) -> None:
        super().__init__(prompt=text, prompt_token_ids=token_ids)
        self.mm_features = mm_features


class ProcessedPair(tuple):
    """The server's (prompt text, prompt token ids) pair that also carries the prompt's MultiModalFeatures: it
    unpacks as the plain pair wherever only text and ids matter."""

    def __new__(cls, text: str | None, token_ids: list[int], mm_features: list[MultiModalFeature]) -> ProcessedPair:
        pair = super().__new__(cls, (text, token_ids))
        pair.mm_features = mm_features
        return pair

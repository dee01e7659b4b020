"""One multimodal item of a prompt after processing: its tensors, its hash and where its placeholder tokens are."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MultiModalFeature:
    modality: str  # "image"
    identifier: str  # hex digest of the item's content and the processor options: the encoder cache key
    offset: int  # position of the item's first placeholder token in the prompt
    length: int  # number of placeholder tokens the encoder output fills
    data: dict[str, torch.Tensor]  # the processor's tensors for this item alone, e.g. pixel_values [1, 3, H, W]

    @property
    def end(self) -> int:
        return self.offset + self.length

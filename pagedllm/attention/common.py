"""What every attention backend is built from: the flat batch's layout over the paged cache."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class BatchLayout:
    """The step's requests laid out in one flat token batch (host arrays, built by the model runner)."""

    query_start_loc: np.ndarray  # [num_reqs + 1] int64, cumulative query lengths
    seq_lens: np.ndarray  # [num_reqs] int64, context + query length of each request
    block_table: np.ndarray  # [num_reqs, max_blocks] int64, block ids of each request
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot of each new token
    block_size: int
    device: torch.device

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start_loc)

"""The persistent batch: per-request rows of tokens, block tables and sampling parameters kept across steps."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.sampling_params import SamplingParams


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int64)  # [rows, max_len]
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int64)  # [rows, max_blocks]
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.generators: dict[int, torch.Generator] = {}
        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))

    def add(
        self,
        req_id: str,
        token_ids: list[int],
        block_ids: list[int],
        num_computed: int,
        params: SamplingParams,
        device: torch.device,
    ) -> None:
        row = self.free_rows.pop()
        self.row_of[req_id] = row
        n = len(token_ids)
        self.token_ids[row, :n] = token_ids
        self.num_tokens[row] = n
        self.num_computed[row] = num_computed
        self.num_blocks[row] = 0
        self.append_blocks(row, block_ids)
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k_enabled
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        if params.seed is not None:
            self.generators[row] = torch.Generator(device=device).manual_seed(params.seed)

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.generators.pop(row, None)
            self.free_rows.append(row)

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = self.num_blocks[row]
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def append_token(self, row: int, token_id: int) -> None:
        self.token_ids[row, self.num_tokens[row]] = token_id
        self.num_tokens[row] += 1

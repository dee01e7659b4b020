"""Token embedding and LM head (vocab-parallel by name; one rank holds the whole vocabulary)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.linear import default_weight_loader, pack_for_cpu, packed_linear


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)  # [vocab, hidden]
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        default_weight_loader(param, loaded)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size, hidden_size)
        self.cpu_weight: torch.Tensor | None = None  # reordered for oneDNN (a copy when tied to the embedding)
        self.tied = False

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight
        self.tied = True

    def process_weights_after_loading(self) -> None:
        self.cpu_weight = pack_for_cpu(self.weight)
        if self.cpu_weight is not None and not self.tied:
            self.weight = None

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] logits, float32 unless upcast=False (then in the model dtype: the argmax and
        the GPU sampling kernel read them as they are, exactly, without a float32 copy)."""
        if self.cpu_weight is not None:
            logits = packed_linear(hidden, self.cpu_weight, None)
        else:
            logits = F.linear(hidden, self.weight)
        return logits.float() if upcast else logits


class LearnedPositionEmbedding(VocabParallelEmbedding):
    """A learned absolute position table (OPT, GPT-2, ...): position p reads row p + offset (OPT keeps 2 rows first)."""

    def __init__(self, num_positions: int, hidden_size: int, offset: int = 0) -> None:
        super().__init__(num_positions + offset, hidden_size)
        self.offset = offset

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions + self.offset if self.offset else positions, self.weight)

"""Token embedding and LM head, split by vocabulary rows across the tensor-parallel ranks.

Rank r holds rows [r * s, (r + 1) * s) with s = ceil(vocab / tp_size) (the last rank's tail past the vocabulary is
zero padding). The embedding looks up the ids in its range, zeroes the others and sums over the ranks; the LM head
computes its slice of the logits and gathers the slices. With one rank each holds the whole table."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.kernels import cpu_quant
from pagedllm.layers.build_context import current_build_context
from pagedllm.layers.linear import default_weight_loader, pack_for_cpu, packed_linear
from pagedllm.layers.q4_linear import MAX_ROWS


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, parallel: bool = True) -> None:
        super().__init__()
        context = current_build_context()
        self.tp_group = context.tp_group if parallel and context.tp_size > 1 else None
        tp_size, tp_rank = (context.tp_size, context.tp_rank) if self.tp_group is not None else (1, 0)
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // tp_size)
        self.first_row = tp_rank * self.rows_per_rank
        self.num_rows = min(self.rows_per_rank, max(0, vocab_size - self.first_row))  # real rows (without padding)
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size), requires_grad=False)  # [rows, hidden]
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
        if self.tp_group is None:
            default_weight_loader(param, loaded)
            if hasattr(loaded, "gguf_q8"):  # a GGUF Q8_0 table: its 8-bit form, for the LM head's kernel
                param.gguf_q8 = loaded.gguf_q8
            return
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"checkpoint embedding has {loaded.shape[0]} rows, the vocabulary {self.vocab_size}")
        param.data[self.num_rows :].zero_()
        default_weight_loader(param.data[: self.num_rows], loaded.narrow(0, self.first_row, self.num_rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group is None:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.first_row
        outside = (local < 0) | (local >= self.num_rows)  # [num_tokens] ids another rank holds
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # [num_tokens, hidden]
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp_group.all_reduce(x)


class ParallelLMHead(VocabParallelEmbedding):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size, hidden_size)
        self.cpu_weight: torch.Tensor | None = None  # reordered for oneDNN (a copy when tied to the embedding)
        self.q8_weight: cpu_quant.QuantWeight | None = None  # a GGUF Q8_0 head kept 8-bit (CPU)
        self.tied = False

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight
        self.tied = True

    def process_weights_after_loading(self) -> None:
        q8 = getattr(self.weight, "gguf_q8", None)
        if q8 is not None and self.weight.device.type == "cpu" and cpu_quant.available():
            self.q8_weight = cpu_quant.pack_q8(*q8)  # batches of decode size read the 8-bit rows
            del self.weight.gguf_q8
        self.cpu_weight = pack_for_cpu(self.weight)
        if self.cpu_weight is not None and not self.tied:
            self.weight = None

    def shards_logits(self) -> bool:
        """Whether shard_logits gives this rank's slice of the logits as they are (a GPU weight, no bias)."""
        plain = type(self).compute_logits is ParallelLMHead.compute_logits
        return plain and self.weight is not None and self.cpu_weight is None and self.q8_weight is None

    def shard_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> this rank's slice of the logits [n, rows_per_rank] in the model's dtype: tokens first_row
        .. first_row + num_rows, then zero padding (see shards_logits)."""
        return F.linear(hidden, self.weight)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] logits, float32 unless upcast=False (then in the model dtype: the argmax and
        the GPU sampling kernel read them as they are, exactly, without a float32 copy). With several ranks every
        rank gets the whole vocabulary's logits."""
        if self.q8_weight is not None and hidden.shape[0] <= MAX_ROWS and cpu_quant.runs(hidden):
            logits = cpu_quant.quant_linear(hidden, self.q8_weight)
        elif self.cpu_weight is not None:
            logits = packed_linear(hidden, self.cpu_weight, None)
        else:
            logits = F.linear(hidden, self.weight)
        if self.tp_group is not None:  # [n, rows_per_rank] on each rank -> [n, vocab]
            logits = self.tp_group.all_gather(logits)[:, : self.vocab_size]
            logits = logits if logits.is_contiguous() else logits.contiguous()
        return logits.float() if upcast else logits


class LearnedPositionEmbedding(VocabParallelEmbedding):
    """A learned absolute position table (OPT, GPT-2, ...): position p reads row p + offset (OPT keeps 2 rows first).
    Every rank holds the whole table."""

    def __init__(self, num_positions: int, hidden_size: int, offset: int = 0) -> None:
        super().__init__(num_positions + offset, hidden_size, parallel=False)
        self.offset = offset

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions + self.offset if self.offset else positions, self.weight)

"""What the pooling API returns (`encode`, `embed`, `classify`, `score`), with vLLM's class and field names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass
class PoolingOutput:
    data: torch.Tensor  # the pooled value: [hidden] (or [dimensions]), [num_labels], or [num_tokens, hidden]


@dataclass
class EmbeddingPoolingOutput(PoolingOutput):
    """`encode`'s output for the embed task: the pooled tensor (`.data`, as vLLM's PoolingOutput) and the same vector
    as a list of floats (`.embedding`, as vLLM's examples of `encode` on an embedding model read it)."""

    @property
    def embedding(self) -> list[float]:
        return EmbeddingOutput.from_base(self).embedding


@dataclass
class PoolingRequestOutput:
    """One prompt's result of `LLM.encode`; the base of the task-specific outputs below."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None

    output_type: ClassVar[type]  # a task's output class, with from_base(PoolingOutput)

    @classmethod
    def from_base(cls, out: PoolingRequestOutput):
        """The task-specific request output of a plain pooling result."""
        return cls(
            out.request_id, cls.output_type.from_base(out.outputs), out.prompt_token_ids, out.finished, out.prompt
        )


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)

    @staticmethod
    def from_base(output: PoolingOutput) -> EmbeddingOutput:
        if output.data.ndim != 1:
            raise ValueError(f"an embedding is one vector; got a tensor of shape {tuple(output.data.shape)}")
        return EmbeddingOutput(output.data.tolist())


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    outputs: EmbeddingOutput  # type: ignore[assignment]
    output_type: ClassVar[type] = EmbeddingOutput


@dataclass
class ClassificationOutput:
    probs: list[float]  # one value per label (softmax / sigmoid unless use_activation=False)

    @property
    def num_classes(self) -> int:
        return len(self.probs)

    @staticmethod
    def from_base(output: PoolingOutput) -> ClassificationOutput:
        return ClassificationOutput(output.data.tolist())


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput):
    outputs: ClassificationOutput  # type: ignore[assignment]
    output_type: ClassVar[type] = ClassificationOutput


@dataclass
class ScoringOutput:
    score: float

    @staticmethod
    def from_base(output: PoolingOutput) -> ScoringOutput:
        return ScoringOutput(float(output.data.reshape(-1)[0]))


@dataclass
class ScoringRequestOutput(PoolingRequestOutput):
    outputs: ScoringOutput  # type: ignore[assignment]
    output_type: ClassVar[type] = ScoringOutput

"""Pooling a flat batch of token states into one vector per sequence, and the heads applied after it
(Matryoshka truncation + normalization for embeddings, softmax / sigmoid / identity for classifiers)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pool(hidden: torch.Tensor, seq_lens: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """hidden [num_tokens, hidden] with the sequences back to back, seq_lens [num_seqs] (int64)
    -> [num_seqs, hidden] float32: the mean, first (CLS), last or element-wise max token state of each sequence."""
    ends = torch.cumsum(seq_lens, 0)  # [num_seqs]
    if pooling_type == "CLS":
        return hidden[ends - seq_lens].float()
    if pooling_type == "LAST":
        return hidden[ends - 1].float()
    if pooling_type == "MEAN":  # one small mean per sequence: on CPU 20-40x faster than index_add_
        return torch.stack([x.float().mean(0) for x in hidden.split(seq_lens.tolist())])  # [num_seqs, hidden]
    if pooling_type == "MAX":
        return torch.segment_reduce(hidden.float(), "max", lengths=seq_lens, axis=0)
    raise ValueError(f"pooling_type={pooling_type!r} must be one of MEAN, CLS, LAST, MAX")


def embed_head(pooled: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """[n, hidden] -> [n, dimensions or hidden]: keep the first `dimensions` features, then L2-normalize."""
    if dimensions is not None:
        pooled = pooled[..., :dimensions]
    return F.normalize(pooled, p=2, dim=-1) if normalize else pooled


ACTIVATIONS = ("auto", "softmax", "sigmoid", "identity", "tanh")


def classify_head(logits: torch.Tensor, activation: str) -> torch.Tensor:
    """[..., num_labels] logits -> scores: "auto" is softmax over several labels and sigmoid for a single one;
    "identity" (or use_activation=False) keeps the logits."""
    if activation == "auto":
        activation = "sigmoid" if logits.shape[-1] == 1 else "softmax"
    if activation == "softmax":
        return torch.softmax(logits, dim=-1)
    if activation == "sigmoid":
        return torch.sigmoid(logits)
    if activation == "tanh":
        return torch.tanh(logits)
    if activation == "identity":
        return logits
    raise ValueError(f"activation={activation!r} must be one of {ACTIVATIONS}")

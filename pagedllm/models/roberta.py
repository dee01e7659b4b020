"""RoBERTa and XLM-RoBERTa encoders (bge-m3 style embedders, bge-reranker style cross-encoders, token classifiers):
BERT's layers with positions counted from padding_idx + 1, one token type, and a dense + tanh + out_proj
classification head (a plain linear per token for token classification)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.layers.linear import ReplicatedLinear
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.models.bert import BertEmbeddings, BertForTokenClassification, BertModel, load_bert_weights
from pagedllm.models.utils import join_prefix


def roberta_position_offset(config) -> int:
    """padding_idx + 1: the position-table row of a sequence's first token (padding_idx 1 when the config has none)."""
    pad = getattr(config, "pad_token_id", None)
    return (1 if pad is None else int(pad)) + 1


class RobertaEmbeddings(BertEmbeddings):
    """Position p of a sequence reads row padding_idx + 1 + p (HF counts positions past the padding id)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.position_offset = roberta_position_offset(config)


class RobertaModel(BertModel):
    """The encoder; pooled by the pooling runner (CLS unless sentence-transformers files say otherwise). A single
    token type: segment ids of a text pair are not used (RoBERTa's tokenizers give none)."""

    uses_token_type_ids = False
    embeddings_cls = RobertaEmbeddings

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_bert_weights(self, weights, prefix="", base="roberta.")


class RobertaClassificationHead(nn.Module):
    """out_proj(tanh(dense(first token state))): HF's RobertaClassificationHead without its dropouts."""

    def __init__(self, config, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        hidden, num_labels = config.hidden_size, int(config.num_labels)
        self.dense = ReplicatedLinear(hidden, hidden, True, quant_config, join_prefix(prefix, "dense"))
        self.out_proj = ReplicatedLinear(hidden, num_labels, True, quant_config, join_prefix(prefix, "out_proj"))

    def forward(self, cls_hidden: torch.Tensor) -> torch.Tensor:  # [num_seqs, hidden] -> [num_seqs, num_labels]
        return self.out_proj(torch.tanh(self.dense(cls_hidden)))


class RobertaForSequenceClassification(nn.Module):
    """A cross-encoder (bge-reranker): CLS state -> classification head [num_labels]."""

    is_causal = False
    supports_tensor_parallel = True
    uses_token_type_ids = False

    def __init__(
        self,
        config,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        *,
        max_position: int | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.num_labels = int(config.num_labels)
        self.roberta = RobertaModel(config, quant_config, join_prefix(prefix, "roberta"), max_position=max_position)
        self.classifier = RobertaClassificationHead(config, quant_config, join_prefix(prefix, "classifier"))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.roberta(input_ids, positions)  # [num_tokens, hidden]

    def classify(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        """[num_seqs, hidden] first-token states -> [num_seqs, num_labels] float32 logits."""
        return self.classifier(cls_hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_bert_weights(self, weights, prefix="roberta.", base="roberta.")


class XLMRobertaModel(RobertaModel):
    """XLM-RoBERTa (bge-m3): RoBERTa's architecture with a larger vocabulary."""


class XLMRobertaForSequenceClassification(RobertaForSequenceClassification):
    """XLM-RoBERTa cross-encoder (bge-reranker)."""


class RobertaForTokenClassification(BertForTokenClassification):
    """Per-token labels (NER) over RoBERTa: every token's final state -> classifier [num_labels]."""

    uses_token_type_ids = False
    encoder_name = "roberta"

    @staticmethod
    def make_encoder(config, quant_config, prefix: str, max_position: int | None) -> nn.Module:
        return RobertaModel(config, quant_config, prefix, max_position=max_position)


class XLMRobertaForTokenClassification(RobertaForTokenClassification):
    """XLM-RoBERTa token classifier."""

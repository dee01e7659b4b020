"""BERT encoders: BertModel (embeddings, pooled by the pooling runner), BertForSequenceClassification
(cross-encoders) and BertForTokenClassification (NER: one label row per token). Bidirectional attention over a
padding-free batch; no KV cache."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.attention import Attention
from pagedllm.layers.build_context import current_build_context, divide
from pagedllm.layers.linear import (
    ONEDNN,
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.vocab_embedding import VocabParallelEmbedding
from pagedllm.models.utils import join_prefix, load_weights

# (our fragment, HF fragment, shard id) of the fused q/k/v projection
_STACKED = [
    (".attention.qkv_proj.", ".attention.self.query.", "q"),
    (".attention.qkv_proj.", ".attention.self.key.", "k"),
    (".attention.qkv_proj.", ".attention.self.value.", "v"),
]
_GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}  # HF hidden_act -> GELU approximation


def _layer_norm(config) -> nn.LayerNorm:
    norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
    norm.requires_grad_(False)
    return norm


class LinearGelu(ColumnParallelLinear):
    """gelu(x @ W.T + b); with the dense weight packed for oneDNN the GELU is fused into oneDNN's matmul."""

    use_tiles = False  # its forward always takes oneDNN's fused matmul

    def __init__(
        self,
        input_size: int,
        output_size: int,
        approximate: str,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(input_size, output_size, True, quant_config, prefix)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is ONEDNN:
            return torch.ops.mkldnn._linear_pointwise(x, self.cpu_weight, self.bias, "gelu", [], self.approximate)
        return F.gelu(self.quant_method.apply(self, x), approximate=self.approximate)


class BertEmbeddings(nn.Module):
    position_offset = 0  # RoBERTa's positions start after its padding id

    def __init__(self, config) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = VocabParallelEmbedding(
            config.max_position_embeddings, config.hidden_size, parallel=False
        )
        self.token_type_embeddings = VocabParallelEmbedding(config.type_vocab_size, config.hidden_size, parallel=False)
        self.LayerNorm = _layer_norm(config)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None
    ) -> torch.Tensor:
        if self.position_offset:
            positions = positions + self.position_offset
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)  # [num_tokens, hidden]
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x)


class BertSelfOutput(nn.Module):
    """LayerNorm(dense(x) + residual): the output block after attention and after the MLP."""

    def __init__(
        self, config, input_size: int, quant_config: QuantizationConfig | None = None, prefix: str = ""
    ) -> None:
        super().__init__()
        self.dense = RowParallelLinear(input_size, config.hidden_size, True, quant_config, join_prefix(prefix, "dense"))
        self.dense.use_tiles = False  # forward fuses the residual add into oneDNN's matmul
        self.LayerNorm = _layer_norm(config)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        dense = self.dense
        if dense.quant_method is ONEDNN and dense.tp_size == 1:  # the residual add fused into oneDNN's matmul
            out = torch.ops.mkldnn._linear_pointwise.binary(x, residual, dense.cpu_weight, dense.bias, "add")
            return self.LayerNorm(out)
        return self.LayerNorm(dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        heads = config.num_attention_heads
        self.head_dim = config.hidden_size // heads
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, heads, heads, True, quant_config, join_prefix(prefix, "qkv_proj")
        )
        self.num_heads = divide(heads, current_build_context().tp_size, "num_attention_heads")  # this rank's heads
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_heads)
        self.output = BertSelfOutput(config, config.hidden_size, quant_config, join_prefix(prefix, "output"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)  # each [num_tokens, this rank's heads * head_dim]
        return self.output(self.attn(q, k, v), x)


class BertLayer(nn.Module):
    def __init__(self, config, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        act = config.hidden_act
        if act not in _GELU:
            raise ValueError(f"hidden_act={act!r} is not supported for BERT; supported: {sorted(_GELU)}")
        self.attention = BertAttention(config, quant_config, join_prefix(prefix, "attention"))
        self.intermediate = nn.Module()
        self.intermediate.dense = LinearGelu(
            config.hidden_size,
            config.intermediate_size,
            _GELU[act],
            quant_config,
            join_prefix(prefix, "intermediate.dense"),
        )
        self.output = BertSelfOutput(config, config.intermediate_size, quant_config, join_prefix(prefix, "output"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attention(x)
        return self.output(self.intermediate.dense(x), x)


class BertPooler(nn.Module):
    """tanh(dense(first token)): BERT's sentence head, used by the classifier."""

    def __init__(self, config, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        hidden = config.hidden_size
        self.dense = ReplicatedLinear(hidden, hidden, True, quant_config, join_prefix(prefix, "dense"))

    def forward(self, cls_hidden: torch.Tensor) -> torch.Tensor:  # [num_seqs, hidden]
        return torch.tanh(self.dense(cls_hidden))


class BertModel(nn.Module):
    """The encoder; the pooling runner pools its token states (mean / CLS / last, from the model's
    sentence-transformers config). BERT's own pooler weights are only read by the classifier. With tensor
    parallelism each rank holds its heads and its share of the MLP (one all-reduce after each); the heads after the
    encoder are small and whole on every rank."""

    is_causal = False
    supports_tensor_parallel = True
    uses_token_type_ids = True
    embeddings_cls = BertEmbeddings

    def __init__(
        self,
        config,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        *,
        max_position: int | None = None,
        add_pooler: bool = False,
    ) -> None:
        super().__init__()
        position_type = getattr(config, "position_embedding_type", "absolute")
        if position_type != "absolute":
            raise ValueError(f"position_embedding_type={position_type!r} is not supported; supported: 'absolute'")
        self.embeddings = self.embeddings_cls(config)
        longest = config.max_position_embeddings - self.embeddings.position_offset
        if max_position is not None and max_position > longest:
            raise ValueError(
                f"max_model_len={max_position} is out of range: [1, {longest}] "
                f"({type(self).__name__} has one learned position embedding per position)"
            )
        self.config = config
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(
            BertLayer(config, quant_config, join_prefix(prefix, f"encoder.layer.{i}"))
            for i in range(config.num_hidden_layers)
        )
        self.pooler = BertPooler(config, quant_config, join_prefix(prefix, "pooler")) if add_pooler else None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = self.embeddings(input_ids, positions, token_type_ids)  # [num_tokens, hidden]
        for layer in self.encoder.layer:
            x = layer(x)
        return x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_bert_weights(self, weights, prefix="")


class BertForSequenceClassification(nn.Module):
    """A cross-encoder: CLS state -> BERT pooler (dense + tanh) -> classifier [num_labels]."""

    is_causal = False
    supports_tensor_parallel = True
    uses_token_type_ids = True

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
        bert_prefix = join_prefix(prefix, "bert")
        self.bert = BertModel(config, quant_config, bert_prefix, max_position=max_position, add_pooler=True)
        classifier_prefix = join_prefix(prefix, "classifier")
        self.classifier = ReplicatedLinear(config.hidden_size, self.num_labels, True, quant_config, classifier_prefix)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.bert(input_ids, positions, token_type_ids)  # [num_tokens, hidden]

    def classify(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        """[num_seqs, hidden] first-token states -> [num_seqs, num_labels] float32 logits."""
        return self.classifier(self.bert.pooler(cls_hidden)).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_bert_weights(self, weights, prefix="bert.")


class BertForTokenClassification(nn.Module):
    """Per-token labels (NER): every token's final state -> classifier [num_labels] (HF's dropout is a no-op). A
    subclass names another encoder (`encoder_name`, `make_encoder`): RoBERTa's."""

    is_causal = False
    supports_tensor_parallel = True
    uses_token_type_ids = True
    encoder_name = "bert"  # the encoder's attribute, and its checkpoint prefix

    @staticmethod
    def make_encoder(config, quant_config, prefix: str, max_position: int | None) -> nn.Module:
        return BertModel(config, quant_config, prefix, max_position=max_position)

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
        encoder = self.make_encoder(config, quant_config, join_prefix(prefix, self.encoder_name), max_position)
        setattr(self, self.encoder_name, encoder)
        classifier_prefix = join_prefix(prefix, "classifier")
        self.classifier = ReplicatedLinear(config.hidden_size, self.num_labels, True, quant_config, classifier_prefix)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        encoder = getattr(self, self.encoder_name)
        if not self.uses_token_type_ids:
            return encoder(input_ids, positions)  # [num_tokens, hidden]
        return encoder(input_ids, positions, token_type_ids)  # [num_tokens, hidden]

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_tokens, hidden] token states -> [num_tokens, num_labels] float32 logits."""
        return self.classifier(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        name = self.encoder_name + "."
        return load_bert_weights(self, weights, prefix=name, base=name)


def _renamer(prefix: str, base: str) -> Callable[[str], str]:
    """HF checkpoint name -> our parameter name, before the fused q/k/v (_STACKED). base: the encoder's name in a
    task model ("bert.", "roberta.")."""

    def rename(hf_name: str) -> str:
        name = hf_name.replace(".gamma", ".weight").replace(".beta", ".bias")  # very old checkpoints
        if prefix and not name.startswith(prefix) and not name.startswith("classifier."):
            name = prefix + name  # an encoder saved without its "bert." prefix
        if not prefix and name.startswith(base):
            name = name[len(base) :]  # encoder weights taken from a task model
        return name

    return rename


# tensors of heads and buffers the models do not use: MLM / NSP heads, an unused pooler, position / type id buffers
_IGNORE = ("position_ids", "token_type_ids", "cls.", "lm_head.", "pooler.")


def load_bert_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], prefix: str, base: str = "bert."
) -> set[str]:
    """Copies HF BERT-layout weights into `model` (q/k/v fused); heads the model does not have are skipped.
    Returns the parameter names loaded completely."""
    return load_weights(model, weights, _STACKED, _renamer(prefix, base), ignore=_IGNORE)

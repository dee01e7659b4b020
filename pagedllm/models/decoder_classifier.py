"""Decoder sequence classifiers (LlamaForSequenceClassification, Qwen2ForSequenceClassification, ...): a family's
decoder stack and final norm, then HF's `score` linear (no bias) over each prompt's last token. They only pool: the
pooling runner takes the last token's final state (a batch has no padding, so it is HF's last non-pad token) and
hands it to `classify`."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.layers.linear import ReplicatedLinear
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.models.causal_lm import CausalLM
from pagedllm.models.gemma import GemmaForCausalLM
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.mistral import MistralForCausalLM
from pagedllm.models.phi3 import Phi3ForCausalLM
from pagedllm.models.qwen2 import Qwen2ForCausalLM
from pagedllm.models.qwen3 import Qwen3ForCausalLM
from pagedllm.models.starcoder2 import Starcoder2ForCausalLM
from pagedllm.models.utils import join_prefix, load_weights


class DecoderForSequenceClassification(nn.Module):
    """The decoder of `causal_lm_cls` (its class, attribute and checkpoint layout) with a score head in place of
    the LM head. Split over ranks as the decoder is; the small head is whole on every rank."""

    causal_lm_cls: type[CausalLM]  # the family's generative class: its decoder and weight names

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        lm = cls.causal_lm_cls
        cls.supports_tensor_parallel = getattr(lm, "supports_tensor_parallel", False)
        cls.supports_pipeline_parallel = getattr(lm, "supports_pipeline_parallel", False)

    def __init__(
        self, config, quant_config: QuantizationConfig | None = None, prefix: str = "", *, max_position: int
    ) -> None:
        super().__init__()
        lm = self.causal_lm_cls
        num_labels = int(getattr(config, "num_labels", 0) or 0)
        if num_labels < 1:
            raise ValueError(f"num_labels={num_labels} is out of range: >= 1 (the config's label count)")
        self.config = config
        self.num_labels = num_labels
        kwargs = {"max_position": max_position} if lm.model_takes_max_position else {}
        decoder = lm.model_cls(config, quant_config, join_prefix(prefix, lm.model_attr), **kwargs)
        setattr(self, lm.model_attr, decoder)
        self.score = ReplicatedLinear(config.hidden_size, num_labels, False, quant_config, join_prefix(prefix, "score"))

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate: tuple | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """hidden [num_tokens, hidden] (final norm applied); a stage before the last: see LlamaModel.forward."""
        decoder = getattr(self, self.causal_lm_cls.model_attr)
        if intermediate is None:
            return decoder(input_ids, positions)
        return decoder(input_ids, positions, intermediate)

    def classify(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """[num_seqs, hidden] last-token states -> [num_seqs, num_labels] float32 logits."""
        return self.score(last_hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        lm = self.causal_lm_cls
        ignore = ("rotary_emb.inv_freq", "lm_head.", *lm.extra_ignore)  # a head saved beside the score: unused
        return load_weights(self, weights, lm.stacked, lm.rename, ignore=ignore, convert=lm.convert)


class LlamaForSequenceClassification(DecoderForSequenceClassification):
    causal_lm_cls = LlamaForCausalLM


class MistralForSequenceClassification(DecoderForSequenceClassification):
    causal_lm_cls = MistralForCausalLM


class Qwen2ForSequenceClassification(DecoderForSequenceClassification):
    causal_lm_cls = Qwen2ForCausalLM


class Qwen3ForSequenceClassification(DecoderForSequenceClassification):
    causal_lm_cls = Qwen3ForCausalLM


class GemmaForSequenceClassification(DecoderForSequenceClassification):
    causal_lm_cls = GemmaForCausalLM


class Phi3ForSequenceClassification(DecoderForSequenceClassification):
    causal_lm_cls = Phi3ForCausalLM


class Starcoder2ForSequenceClassification(DecoderForSequenceClassification):
    causal_lm_cls = Starcoder2ForCausalLM

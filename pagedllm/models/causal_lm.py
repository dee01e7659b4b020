"""The ForCausalLM shell the decoder-only models share: the decoder under its checkpoint attribute, the LM head
(tied to the decoder's input embedding where the config says so), forward, compute_logits and load_weights. A model
class sets what differs as class attributes and overrides `rename` / `convert` where its checkpoint needs them."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from pagedllm.layers.build_context import current_build_context
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.vocab_embedding import ParallelLMHead
from pagedllm.models.utils import (
    STACKED_PARAMS,
    MissingLayer,
    check_learned_positions,
    join_prefix,
    load_weights,
    tied_ignore,
)


class CausalLM(nn.Module):
    model_cls: type[nn.Module]  # the decoder: (config, quant_config, prefix[, max_position=]) -> hidden states
    model_attr = "model"  # its attribute here, also its weights' prefix in checkpoints
    embedding_attr = "embed_tokens"  # the decoder's input embedding (dotted path), which a tied head shares
    head_attr = "lm_head"
    head_cls: type[nn.Module] = ParallelLMHead
    tie_default = False  # tie_word_embeddings when the config does not say
    model_takes_max_position = True  # rotary decoders size their tables by max_position
    learned_positions = False  # a learned position table: refuse a longer max_model_len
    stacked: list[tuple[str, str, object]] = STACKED_PARAMS  # load_weights' merged projections
    tied_head_ignore: str | None = None  # the tied head's checkpoint tensors to skip (default: all of "<head>.")
    extra_ignore: tuple[str, ...] = ()  # checkpoint tensors with no parameter (e.g. old attention-mask buffers)
    rename: Callable[[str], str] | None = None  # checkpoint name -> our name
    convert: Callable[[str, torch.Tensor], torch.Tensor] | None = None  # (our name, tensor) -> tensor in our layout

    def __init__(
        self, config, quant_config: QuantizationConfig | None = None, prefix: str = "", *, max_position: int
    ) -> None:
        super().__init__()
        if self.learned_positions:
            check_learned_positions(config, max_position)
        self.config = config
        kwargs = {"max_position": max_position} if self.model_takes_max_position else {}
        decoder = self.model_cls(config, quant_config, join_prefix(prefix, self.model_attr), **kwargs)
        setattr(self, self.model_attr, decoder)
        self.tied = bool(getattr(config, "tie_word_embeddings", self.tie_default))
        if current_build_context().pp_rank > 0:  # the first pipeline stage computes the logits
            setattr(self, self.head_attr, MissingLayer())
            return
        head = self.head_cls(config.vocab_size, self.head_size(config))
        setattr(self, self.head_attr, head)
        if self.tied:
            head.tie(decoder.get_submodule(self.embedding_attr))

    @staticmethod
    def head_size(config) -> int:
        """The width of the hidden states the LM head takes."""
        return config.hidden_size

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate: tuple | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """hidden [num_tokens, head_size]; with pipeline parallelism see LlamaModel.forward."""
        decoder = getattr(self, self.model_attr)
        if intermediate is None:
            return decoder(input_ids, positions)
        return decoder(input_ids, positions, intermediate)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        return getattr(self, self.head_attr).compute_logits(hidden, upcast)  # [n, vocab] float32 unless not upcast

    def logits_head(self):
        """The LM head whose slices of the logits are the model's logits as they are (each rank may sample over its
        own: pagedllm/sample/vocab_race.py), or None where the model changes them after the head."""
        head = getattr(self, self.head_attr)
        plain = type(self).compute_logits is CausalLM.compute_logits
        return head if plain and isinstance(head, ParallelLMHead) and head.shards_logits() else None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        ignore = (*tied_ignore(self.tied, self.tied_head_ignore or f"{self.head_attr}."), *self.extra_ignore)
        return load_weights(self, weights, self.stacked, self.rename, ignore, self.convert)

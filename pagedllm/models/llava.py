"""LLaVA: a CLIP vision tower, a two-layer projector and a decoder LM (Llama, Mistral or Qwen2). Each image's
projected features replace the input embeddings of its placeholder tokens; everything else is the LM's.

Tensor parallelism: the LM shards as a text model; the tower (clip.py) and the projector (linear_1 column-, linear_2
row-parallel) shard too where their sizes split over the ranks, else are replicated. Either way every rank computes
the same image embeddings, each rank encoding the items of the step it receives (the same on every rank)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers.activations import ACT2FN

from pagedllm.layers.build_context import current_build_context, sharded_if_divisible
from pagedllm.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.models.clip import CLIP_STACKED, CLIPVisionTower
from pagedllm.models.registry import get_model_class
from pagedllm.models.utils import MissingLayer, forward_with_mm_embeds, join_prefix, load_with_language_model

_TEXT_MODELS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# checkpoint prefixes (transformers' newer layout, and CLIPVisionModel's) -> ours
_RENAMES = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("lm_head.", "language_model.lm_head."),
)


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, in_size: int, out_size: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = ColumnParallelLinear(in_size, out_size, bias=bias)
        self.act = ACT2FN[act]
        self.linear_2 = RowParallelLinear(out_size, out_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def _feature_layers(config) -> list[int]:
    """The vision layers LLaVA reads, as counts of layers run (HF's hidden_states index: -2 of 24 layers -> 23)."""
    layers = config.vision_feature_layer
    total = config.vision_config.num_hidden_layers
    return [n if n >= 0 else total + 1 + n for n in (layers if isinstance(layers, (list, tuple)) else [layers])]


def _check_supported(text_config, vision_config) -> None:
    if text_config.model_type not in _TEXT_MODELS:
        raise ValueError(
            f"LLaVA with a {text_config.model_type!r} language model is not supported: one of {sorted(_TEXT_MODELS)}"
        )
    if vision_config.model_type != "clip_vision_model":
        raise ValueError(f"LLaVA with a {vision_config.model_type!r} vision tower is not supported; supported: CLIP")


class LlavaForConditionalGeneration(nn.Module):
    """config: the text config the engine runs (see model_loader), carrying the whole LlavaConfig as
    `vision_language_config`."""

    supports_tensor_parallel = True
    supports_pipeline_parallel = True  # (the tower and projector on the first stage, which embeds the tokens)
    lora_skip_prefixes = ("vision_tower.", "multi_modal_projector.")  # LoRA adapts the language model only

    def __init__(
        self, config, quant_config: QuantizationConfig | None = None, prefix: str = "", *, max_position: int
    ) -> None:
        super().__init__()
        full = config.vision_language_config
        vision = full.vision_config
        _check_supported(config, vision)
        self.layers = _feature_layers(full)
        self.select = full.vision_feature_select_strategy  # "default": drop the class token; "full": keep it
        # limit_mm_per_prompt={"image": 0}: a text model (no vision weights built, loaded or profiled)
        self.supports_multimodal = not getattr(config, "mm_text_only", False)
        self.vision_tower = self.multi_modal_projector = None
        if self.supports_multimodal and current_build_context().pp_rank > 0:  # another stage's parts
            self.vision_tower, self.multi_modal_projector = MissingLayer(), MissingLayer()
        elif self.supports_multimodal:
            self.vision_tower = CLIPVisionTower(vision, max(self.layers))
            bias = getattr(full, "multimodal_projector_bias", True)
            in_size = vision.hidden_size * len(self.layers)
            with sharded_if_divisible(config.hidden_size):
                self.multi_modal_projector = LlavaMultiModalProjector(
                    in_size, config.hidden_size, full.projector_hidden_act, bias
                )
        lm_cls = get_model_class(_TEXT_MODELS[config.model_type])
        self.language_model = lm_cls(
            config, quant_config, join_prefix(prefix, "language_model"), max_position=max_position
        )

    def embed_multimodal(self, modality: str, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's projected features [num_image_tokens, hidden] from pixel_values [1, 3, H, W]."""
        states = self.vision_tower(data["pixel_values"], self.layers)
        features = torch.cat(states, dim=-1)  # [1, 1 + num_patches, vision_hidden * len(layers)]
        if self.select == "default":
            features = features[:, 1:]
        return self.multi_modal_projector(features)[0]

    def dummy_multimodal_data(self) -> dict[str, torch.Tensor]:
        """The largest image input (the only size: the tower's), for the memory profile."""
        size = self.vision_tower.embeddings.position_embedding.num_embeddings - 1
        side = int(round(size**0.5)) * self.vision_tower.embeddings.patch_size
        return {"pixel_values": torch.zeros(1, 3, side, side)}

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate: tuple | None = None,
        mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """mm_embeds: (rows of the flat batch [n], their embeddings [n, hidden]) of image placeholder tokens;
        intermediate: the previous pipeline stage's (hidden, residual) (see LlamaModel.forward)."""
        if intermediate is not None:
            return self.language_model.model(None, positions, intermediate)
        return forward_with_mm_embeds(self.language_model.model, input_ids, positions, mm_embeds)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        return self.language_model.compute_logits(hidden, upcast)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The LM's tensors go through its own loader (merged projections, tied head); the vision tower's and
        the projector's load by name."""
        ignore = ("position_ids", "post_layernorm", *(f"encoder.layers.{i}." for i in range(max(self.layers), 256)))
        return load_with_language_model(self, weights, _RENAMES, stacked=CLIP_STACKED, ignore=ignore)

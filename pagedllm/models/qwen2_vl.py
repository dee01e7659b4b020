"""Qwen2-VL: the Qwen2 vision transformer with its patch merger (qwen2_vl_vision.py) and a Qwen2 LM whose rotary
positions are 3D (M-RoPE): each rotary frequency reads one of the (temporal, height, width) positions, split by the
config's `mrope_section`. Text tokens carry the same position on all three axes; an image's tokens carry their
grid's (t, h, w) offset by the position where the image starts (multimodal/mrope.py computes them per step).

Dynamic resolution: an item is any number of 28x28-pixel merged patches (the processor's min/max pixels), so the
encoder runs on each item's own grid (`image_grid_thw` / `video_grid_thw`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedllm.layers.build_context import current_build_context
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.rope_config import rope_parameters
from pagedllm.models.qwen2 import Qwen2ForCausalLM, Qwen2Model
from pagedllm.models.qwen2_vl_vision import Qwen2VisionTransformer
from pagedllm.models.utils import (
    MissingLayer,
    forward_with_mm_embeds,
    head_dim_of,
    join_prefix,
    load_with_language_model,
)

# checkpoint prefixes (transformers 5's layout, then the original one) -> ours
_RENAMES = (
    ("model.language_model.", "language_model.model."),
    ("model.visual.", "visual."),
    ("lm_head.", "language_model.lm_head."),
    ("model.", "language_model.model."),
)
_VISION_STACKED = [(".gate_up_proj.", ".gate_proj.", 0), (".gate_up_proj.", ".up_proj.", 1)]  # Qwen2.5's MLPs


def mrope_section(config) -> list[int]:
    """The rotary half-dims given to the (t, h, w) positions: rope_parameters (transformers 5) or rope_scaling."""
    for source in (getattr(config, "rope_parameters", None), getattr(config, "rope_scaling", None)):
        if isinstance(source, dict) and source.get("mrope_section"):
            return list(source["mrope_section"])
    raise ValueError("a Qwen2-VL config needs rope_parameters['mrope_section'] (the t/h/w split of the rotary dims)")


class MRotaryEmbedding(nn.Module):
    """Default-frequency rotary for positions [num_tokens] (text: one position on every axis) or [3, num_tokens]
    (t, h, w). Angles are computed per forward in float32, as HF does, so no table bounds M-RoPE's positions."""

    def __init__(self, head_dim: int, theta: float, section: list[int]) -> None:
        super().__init__()
        if sum(section) != head_dim // 2:
            raise ValueError(f"mrope_section={section} must add up to head_dim / 2 = {head_dim // 2}")
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [head_dim / 2]
        axis = torch.cat([torch.full((n,), i) for i, n in enumerate(section)])  # the axis each frequency reads
        self.register_buffer("axis", axis, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [num_tokens, 1, head_dim/2] in `dtype`."""
        if positions.dim() == 1:
            freqs = positions[:, None].float() * self.inv_freq  # [n, head_dim/2]
        else:  # [3, n]: frequency j takes positions[axis[j]]
            freqs = positions.float().t()[:, self.axis] * self.inv_freq
        return freqs.cos().unsqueeze(1).to(dtype), freqs.sin().unsqueeze(1).to(dtype)


class Qwen2VLTextModel(Qwen2Model):
    def make_rotary(self, config, max_position: int) -> nn.Module:
        theta, _ = rope_parameters(config)
        return MRotaryEmbedding(head_dim_of(config), theta, mrope_section(config))


class Qwen2VLTextForCausalLM(Qwen2ForCausalLM):
    model_cls = Qwen2VLTextModel


class Qwen2VLForConditionalGeneration(nn.Module):
    """config: the text config the engine runs (see model_loader), carrying the whole Qwen2VLConfig as
    `vision_language_config`. Tensor parallelism: the LM shards as Qwen2's; the vision transformer too where its
    sizes split over the ranks (qwen2_vl_vision.py), else it is replicated."""

    uses_mrope = True
    supports_tensor_parallel = True
    supports_pipeline_parallel = True  # (the vision transformer on the first stage, which embeds the tokens)
    lora_skip_prefixes = ("visual.",)  # LoRA adapts the language model only

    def __init__(
        self, config, quant_config: QuantizationConfig | None = None, prefix: str = "", *, max_position: int
    ) -> None:
        super().__init__()
        full = config.vision_language_config
        if getattr(full, "tie_word_embeddings", None) is not None:
            config.tie_word_embeddings = full.tie_word_embeddings
        vision = full.vision_config
        self.merge = vision.spatial_merge_size
        # limit_mm_per_prompt of 0 for every modality: a text model (no vision weights built, loaded or profiled)
        self.supports_multimodal = not getattr(config, "mm_text_only", False)
        self.visual = None
        if self.supports_multimodal and current_build_context().pp_rank > 0:
            self.visual = MissingLayer()  # another stage's part (the first embeds the tokens)
        elif self.supports_multimodal:
            self.visual = Qwen2VisionTransformer(vision, config.hidden_size)
        self.patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        self.language_model = Qwen2VLTextForCausalLM(
            config, quant_config, join_prefix(prefix, "language_model"), max_position=max_position
        )

    def embed_multimodal(self, modality: str, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One item's merged features [t * h * w / merge^2, hidden]: pixel_values (or pixel_values_videos)
        [t * h * w, C * T * P * P] with image_grid_thw (video_grid_thw) [1, 3]."""
        key = "pixel_values_videos" if modality == "video" else "pixel_values"
        grid = data["video_grid_thw" if modality == "video" else "image_grid_thw"][0].tolist()
        return self.visual(data[key], tuple(int(g) for g in grid))

    def dummy_multimodal_data(self) -> dict[str, torch.Tensor]:
        """A 1008x1008 image (72x72 patches, 1296 LM tokens) for the memory profile; larger items raise the
        encoder's peak with their size (the processor's max_pixels bounds them)."""
        side = 72
        return {
            "pixel_values": torch.zeros(side * side, self.patch_dim),
            "image_grid_thw": torch.tensor([[1, side, side]]),
        }

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate: tuple | None = None,
        mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens] or M-RoPE's [3, num_tokens]; mm_embeds: (rows of the flat batch [n], their
        embeddings [n, hidden]) of image / video placeholder tokens; intermediate: the previous pipeline stage's
        (hidden, residual) (see LlamaModel.forward)."""
        if intermediate is not None:
            return self.language_model.model(None, positions, intermediate)
        return forward_with_mm_embeds(self.language_model.model, input_ids, positions, mm_embeds)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        return self.language_model.compute_logits(hidden, upcast)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The LM's tensors through its own loader (merged projections, tied head); the vision tower's by name."""
        return load_with_language_model(self, weights, _RENAMES, stacked=_VISION_STACKED, ignore=())

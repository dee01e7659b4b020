"""Gemma 3 with images (Gemma3ForConditionalGeneration): a SigLIP vision tower, Gemma 3's projector (the patch grid
average-pooled to mm_tokens_per_image tokens, RMSNorm, one projection) and the Gemma 3 language model. Each image's
tokens replace the embeddings of its image_token_index placeholders (the processor writes
"\\n\\n<start_of_image>" + mm_tokens_per_image placeholders + "<end_of_image>\\n\\n" for each <start_of_image>).

In prefill the placeholders of one image attend to each other both ways, as transformers' token_type_ids mask has it
(multimodal/bidirectional.py: the attention layers recompute those rows over the cache with an explicit mask).

Pipeline parallelism: the first stage holds the vision tower and the projector and embeds the tokens; every stage
gets the step's ImageSpans (a later one computes them from the items it keeps, with no embeddings: the runner's
MultiModalRunner.step_spans), so that the image rows of each stage's layers attend both ways."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.attention import Attention
from pagedllm.layers.build_context import current_build_context
from pagedllm.layers.layernorm import GemmaRMSNorm
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.models.clip import CLIP_STACKED
from pagedllm.models.gemma3 import Gemma3Attention, Gemma3DecoderLayer, Gemma3ForCausalLM, Gemma3Model
from pagedllm.models.siglip import SiglipVisionTower
from pagedllm.models.utils import (
    MissingLayer,
    forward_with_mm_embeds,
    join_prefix,
    load_with_language_model,
    sliding_window_for_layer,
)
from pagedllm.multimodal.bidirectional import ImageBidirectionalAttention, set_spans

# checkpoint prefixes (transformers >= 4.52, then earlier) -> ours
_RENAMES = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
    ("vision_tower.vision_model.", "vision_tower."),
)


class Gemma3VLAttention(Gemma3Attention):
    def make_attention(self, config, layer_idx: int) -> Attention:
        window = sliding_window_for_layer(config, layer_idx)
        cap = getattr(config, "attn_logit_softcapping", None)
        scale = config.query_pre_attn_scalar**-0.5
        return ImageBidirectionalAttention(
            self.num_heads, self.head_dim, scale, self.num_kv_heads, window, logits_soft_cap=cap
        )


class Gemma3VLDecoderLayer(Gemma3DecoderLayer):
    attention_cls = Gemma3VLAttention


class Gemma3VLModel(Gemma3Model):
    layer_cls = Gemma3VLDecoderLayer


class Gemma3VLForCausalLM(Gemma3ForCausalLM):
    model_cls = Gemma3VLModel


class Gemma3MultiModalProjector(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        vision = config.vision_config
        self.patches_per_side = vision.image_size // vision.patch_size
        tokens_per_side = int(round(config.mm_tokens_per_image**0.5))
        if tokens_per_side**2 != config.mm_tokens_per_image or self.patches_per_side % tokens_per_side:
            raise ValueError(
                f"mm_tokens_per_image={config.mm_tokens_per_image} must be a square whose side divides the "
                f"{self.patches_per_side} patches per side of the vision tower"
            )
        self.kernel = self.patches_per_side // tokens_per_side
        hidden = config.text_config.hidden_size
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision.hidden_size, hidden), requires_grad=False)
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [batch, num_patches, vision_hidden] -> [batch, mm_tokens_per_image, hidden]."""
        b, _, h = x.shape
        grid = x.transpose(1, 2).reshape(b, h, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.kernel).flatten(2).transpose(1, 2)  # [batch, mm_tokens, vision_hidden]
        normed = self.mm_soft_emb_norm(pooled.reshape(-1, h).contiguous()).view(b, -1, h)
        return torch.matmul(normed, self.mm_input_projection_weight)


class Gemma3ForConditionalGeneration(nn.Module):
    """config: the text config the engine runs (see model_loader), carrying the whole Gemma3Config as
    `vision_language_config`."""

    bidirectional_images = True  # the runner hands each step's ImageSpans with the image embeddings
    supports_tensor_parallel = True  # the language model is split; each rank runs the whole vision tower
    supports_pipeline_parallel = True  # (the tower and projector on the first stage; every stage gets the spans)

    def __init__(
        self, config, quant_config: QuantizationConfig | None = None, prefix: str = "", *, max_position: int
    ) -> None:
        super().__init__()
        full = config.vision_language_config
        if full.vision_config.model_type != "siglip_vision_model":
            raise ValueError(f"Gemma 3 with a {full.vision_config.model_type!r} vision tower is not supported: SigLIP")
        # limit_mm_per_prompt={"image": 0}: a text model (no vision weights built, loaded or profiled)
        self.supports_multimodal = not getattr(config, "mm_text_only", False)
        self.vision_tower = self.multi_modal_projector = None
        if self.supports_multimodal and current_build_context().pp_rank > 0:  # another stage's parts
            self.vision_tower, self.multi_modal_projector = MissingLayer(), MissingLayer()
        elif self.supports_multimodal:
            self.vision_tower = SiglipVisionTower(full.vision_config)
            self.multi_modal_projector = Gemma3MultiModalProjector(full)
        self.language_model = Gemma3VLForCausalLM(
            config, quant_config, join_prefix(prefix, "language_model"), max_position=max_position
        )
        self.image_attention = [m for m in self.modules() if isinstance(m, ImageBidirectionalAttention)]

    def embed_multimodal(self, modality: str, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's tokens [mm_tokens_per_image, hidden] from pixel_values [1, 3, image_size, image_size]."""
        return self.multi_modal_projector(self.vision_tower(data["pixel_values"]))[0]

    def dummy_multimodal_data(self) -> dict[str, torch.Tensor]:
        """The largest image input (the only size: the tower's), for the memory profile."""
        side = self.vision_tower.embeddings.image_size
        return {"pixel_values": torch.zeros(1, 3, side, side)}

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate: tuple | None = None,
        mm_embeds=None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """mm_embeds: (rows of the flat batch [n], their embeddings [n, hidden]) of image placeholder tokens, with
        the step's ImageSpans as `mm_embeds.spans`; on a pipeline stage after the first, which takes the previous
        stage's (hidden, residual) as `intermediate` (see LlamaModel.forward), only its spans are used."""
        set_spans(self.image_attention, getattr(mm_embeds, "spans", None))
        try:
            if intermediate is not None:
                return self.language_model.model(None, positions, intermediate)
            return forward_with_mm_embeds(self.language_model.model, input_ids, positions, mm_embeds)
        finally:
            set_spans(self.image_attention, None)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        return self.language_model.compute_logits(hidden, upcast)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The LM's tensors through its own loader, the vision tower's and the projector's by name (SigLIP's pooling
        head, unused, is skipped)."""
        return load_with_language_model(
            self, weights, _RENAMES, stacked=CLIP_STACKED, ignore=("position_ids", "vision_tower.head.")
        )

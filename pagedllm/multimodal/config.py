"""MultiModalConfig: vLLM's multimodal engine options (limit_mm_per_prompt, mm_processor_kwargs, the encoder cache
size and the local media directory), validated once."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

# architecture -> the modalities its prompts take
MULTIMODAL_ARCHITECTURES: dict[str, tuple[str, ...]] = {
    "LlavaForConditionalGeneration": ("image",),
    "Gemma3ForConditionalGeneration": ("image",),
    "Qwen2VLForConditionalGeneration": ("image", "video"),
    "Qwen2_5_VLForConditionalGeneration": ("image", "video"),
}
KNOWN_MODALITIES = ("image", "video", "audio")
_GiB = 1 << 30
DEFAULT_ENCODER_CACHE_GIB = 1.0  # on a GPU it is reserved out of the KV cache's memory


@dataclass
class MultiModalConfig:
    # modality -> the most items one prompt may carry; a modality not named has no limit
    limit_per_prompt: dict[str, int] = field(default_factory=dict)
    processor_kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the HF processor of every prompt
    # bytes of encoder outputs kept (keyed by item hash); VLLM_MM_INPUT_CACHE_GIB sets it in GiB
    encoder_cache_bytes: int = int(DEFAULT_ENCODER_CACHE_GIB * _GiB)
    allowed_local_media_path: str = ""  # file:// image URLs are read only under this directory ("": none)
    enable_embeds: bool = False  # enable_mm_embeds: items may be precomputed embeddings (torch tensors)
    background: tuple[int, int, int] = (255, 255, 255)  # media_io_kwargs' rgba_background_color (chat images)

    @classmethod
    def from_user(
        cls,
        limit_mm_per_prompt: Any,
        mm_processor_kwargs: Any,
        allowed_local_media_path: Any,
        enable_embeds: Any = False,
        media_io_kwargs: Any = None,
    ) -> MultiModalConfig:
        limits = check_limits(limit_mm_per_prompt)
        if mm_processor_kwargs is not None and not isinstance(mm_processor_kwargs, dict):
            raise ValueError(f"mm_processor_kwargs={mm_processor_kwargs!r} must be a dict")
        path = allowed_local_media_path or ""
        if not isinstance(path, str) or (path and not os.path.isdir(path)):
            raise ValueError(f"allowed_local_media_path={allowed_local_media_path!r} must be an existing directory")
        if not isinstance(enable_embeds, bool):
            raise ValueError(f"enable_mm_embeds={enable_embeds!r} must be True or False")
        path = os.path.realpath(path) if path else ""
        background = rgba_background(media_io_kwargs)
        return cls(limits, dict(mm_processor_kwargs or {}), encoder_cache_bytes(), path, enable_embeds, background)

    def text_only(self, architecture: str) -> bool:
        """Every modality the architecture takes is limited to 0 items: it runs without its vision tower."""
        modalities = MULTIMODAL_ARCHITECTURES.get(architecture, ())
        return bool(modalities) and all(self.limit_per_prompt.get(m) == 0 for m in modalities)


def rgba_background(media_io_kwargs: Any) -> tuple[int, int, int]:
    """media_io_kwargs: only {"image": {"rgba_background_color": [R, G, B]}} (0-255 each) is taken."""
    if media_io_kwargs is None:
        return (255, 255, 255)
    image = media_io_kwargs.get("image") if isinstance(media_io_kwargs, dict) else None
    if set(media_io_kwargs or {}) - {"image"} or not isinstance(image, dict) or set(image) - {"rgba_background_color"}:
        raise ValueError(
            f"media_io_kwargs={media_io_kwargs!r} is not supported: the only option is "
            "{'image': {'rgba_background_color': [R, G, B]}}"
        )
    color = image.get("rgba_background_color", (255, 255, 255))
    ok = isinstance(color, (list, tuple)) and len(color) == 3
    if not ok or not all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c <= 255 for c in color):
        raise ValueError(f"media_io_kwargs['image']['rgba_background_color']={color!r} must be 3 integers in [0, 255]")
    return tuple(color)


def check_limits(value: Any) -> dict[str, int]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"limit_mm_per_prompt={value!r} must be a dict like {{'image': 2}}")
    for key, limit in value.items():
        if key not in KNOWN_MODALITIES:
            raise ValueError(f"limit_mm_per_prompt: modality {key!r} is not one of {KNOWN_MODALITIES}")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"limit_mm_per_prompt[{key!r}]={limit!r} must be an integer >= 0")
    return dict(value)


def encoder_cache_bytes() -> int:
    raw = os.environ.get("VLLM_MM_INPUT_CACHE_GIB")
    if raw is None:
        return int(DEFAULT_ENCODER_CACHE_GIB * _GiB)
    try:
        gib = float(raw)
    except ValueError:
        gib = -1.0
    if gib < 0:
        raise ValueError(f"VLLM_MM_INPUT_CACHE_GIB={raw!r} must be a number of GiB >= 0")
    return int(gib * _GiB)

"""Gemma 3's prompts with images: transformers' Gemma3Processor (its PIL image processor: resize to image_size,
rescale, normalize) expands each <start_of_image> in the prompt into the image's placeholder tokens. Each image is
one crop of mm_tokens_per_image tokens whose placeholders attend to each other both ways (`bidirectional`);
pan-and-scan (extra crops per image) is refused."""

from __future__ import annotations

from typing import Any

from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.multimodal.processor import MultiModalProcessor


class Gemma3MultiModalProcessor(MultiModalProcessor):
    takes_embeddings = False  # each image comes wrapped in its own begin/end tokens

    def process(
        self,
        prompt: Any,
        mm_data: Any,
        mm_processor_kwargs: Any = None,
        add_special_tokens: bool = True,
        where: str = "prompt",
    ) -> tuple[list[int], list[MultiModalFeature]]:
        options = mm_processor_kwargs if isinstance(mm_processor_kwargs, dict) else {}
        kwargs = {**self.config.processor_kwargs, **options}
        default = getattr(self.processor.image_processor, "do_pan_and_scan", False)
        if kwargs.get("do_pan_and_scan", default):
            raise ValueError(
                f"{where}.mm_processor_kwargs: do_pan_and_scan=True is not supported for Gemma 3 (each image is one "
                "crop); allowed: False"
            )
        ids, features = super().process(prompt, mm_data, mm_processor_kwargs, add_special_tokens, where)
        for feature in features:
            feature.bidirectional = True
        return ids, features

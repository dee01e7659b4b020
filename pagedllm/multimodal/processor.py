"""MultiModalProcessor: a prompt with multi_modal_data -> prompt token ids (each image placeholder expanded to the
tokens its encoder output fills) and one MultiModalFeature per item, through the model's transformers processor
(AutoProcessor of the model folder)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pagedllm.multimodal.config import MultiModalConfig
from pagedllm.multimodal.hashing import hash_item
from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.multimodal.media import MAX_IMAGE_PIXELS

_TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids")


def check_placeholders(token_ids: list[int], features: list[MultiModalFeature], hf_config: Any) -> None:
    """A prompt's image tokens must be exactly its items' placeholder spans: an image token with no image (typed
    into a text prompt, or given as token ids) would run as a plain embedding."""
    image_id = getattr(hf_config, "image_token_index", None) or getattr(hf_config, "image_token_id", None)
    for modality, token_id in (("image", image_id), ("video", getattr(hf_config, "video_token_id", None))):
        if token_id is None:
            continue
        found = sum(1 for t in token_ids if t == token_id)
        expected = sum(f.length for f in features if f.modality == modality)
        if found != expected:
            raise ValueError(
                f"prompt: {found} {modality} placeholder tokens (id {token_id}) but {expected} from its "
                f"{modality}s; give {modality}s through multi_modal_data with one placeholder per {modality}"
            )


def check_item_size(width: int, height: int, where: str) -> None:
    if width * height > MAX_IMAGE_PIXELS:
        raise ValueError(f"{where} is {width}x{height} pixels, more than the allowed {MAX_IMAGE_PIXELS}")


def check_image(item: Any, where: str) -> None:
    if not (is_image(item) or (isinstance(item, np.ndarray) and item.ndim == 3)):
        raise ValueError(f"{where} has type {type(item).__name__}; expected a PIL.Image or an [H, W, C] numpy array")
    width, height = item.size if is_image(item) else item.shape[1::-1]
    check_item_size(width, height, where)


def make_processor(architecture: str, model_path: str, hf_config: Any, mm_config: MultiModalConfig, trust: bool):
    """The model's multimodal processor: Qwen2-VL's own (qwen2_vl_processor.py), Gemma 3's (gemma3_processor.py),
    else the transformers one."""
    from pagedllm.multimodal.config import MULTIMODAL_ARCHITECTURES

    modalities = MULTIMODAL_ARCHITECTURES[architecture]
    if architecture in ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"):
        from pagedllm.multimodal.qwen2_vl_processor import Qwen2VLProcessor

        return Qwen2VLProcessor(model_path, hf_config, modalities, mm_config, trust)
    if architecture == "Gemma3ForConditionalGeneration":
        from pagedllm.multimodal.gemma3_processor import Gemma3MultiModalProcessor

        return Gemma3MultiModalProcessor(model_path, hf_config, modalities, mm_config, trust)
    return MultiModalProcessor(model_path, hf_config, modalities, mm_config, trust)


def is_image(item: Any) -> bool:
    try:
        from PIL import Image
    except ImportError:
        return False
    return isinstance(item, Image.Image)


class MultiModalProcessor:
    # each image placeholder expands to feature_size tokens of one id (LLaVA): precomputed embeddings can stand in
    takes_embeddings = True

    def __init__(
        self,
        model_path: str,
        hf_config: Any,
        modalities: tuple[str, ...],
        mm_config: MultiModalConfig,
        trust_remote_code: bool = False,
    ) -> None:
        from transformers import AutoProcessor

        try:
            self.processor = AutoProcessor.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:  # a checkpoint saved without its processor: images cannot be prepared
            raise ValueError(f"multi_modal_data: the model folder has no usable processor for images: {e}") from None
        self.modalities = modalities
        self.config = mm_config
        self.hf_config = hf_config
        self.image_token_id = int(getattr(hf_config, "image_token_index", None) or hf_config.image_token_id)
        self.image_placeholder = getattr(self.processor, "image_token", None) or "<image>"

    def items(self, mm_data: Any, where: str) -> dict[str, list]:
        """The prompt's items per modality, checked: known types, a modality the model takes, within the limits."""
        if not isinstance(mm_data, dict):
            raise ValueError(f"{where}.multi_modal_data must be a dict like {{'image': image}}")
        out = {}
        for modality, value in mm_data.items():
            if modality not in self.modalities:
                raise ValueError(
                    f"{where}.multi_modal_data: modality {modality!r} is not one the model takes: {self.modalities}"
                )
            items = self._embeddings(value, f"{where}.multi_modal_data[{modality!r}]")
            if items is None:  # images (PIL or [H, W, C] arrays)
                items = list(value) if isinstance(value, (list, tuple)) else [value]
                for j, item in enumerate(items):
                    check_image(item, f"{where}.multi_modal_data[{modality!r}][{j}]")
            self._check_limit(modality, len(items), where)
            if items:
                out[modality] = items
        return out

    def _check_limit(self, modality: str, count: int, where: str) -> None:
        limit = self.config.limit_per_prompt.get(modality)
        if limit is not None and count > limit:
            raise ValueError(
                f"{where}.multi_modal_data[{modality!r}] has {count} items, more than "
                f"limit_mm_per_prompt[{modality!r}]={limit}: allowed range [0, {limit}]"
            )

    def _embeddings(self, value: Any, where: str) -> list[torch.Tensor] | None:
        """Precomputed image embeddings (enable_mm_embeds) as one [feature_size, hidden] tensor per image, from a
        tensor [num_images, feature_size, hidden] or [feature_size, hidden], or a list of 2-D ones; None when the
        value holds no tensor."""
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if not any(isinstance(v, torch.Tensor) for v in values):
            return None
        if not self.config.enable_embeds:
            raise ValueError(f"{where}: image embeddings (a tensor) need the engine built with enable_mm_embeds=True")
        if not self.takes_embeddings:
            raise ValueError(f"{where}: image embeddings are not supported for this model; give images")
        if not all(isinstance(v, torch.Tensor) for v in values):
            raise ValueError(f"{where}: give either images or image embeddings, not both")
        values = [e for v in values for e in (v if v.ndim == 3 else [v])]  # [feature_size, hidden] each
        hidden = self.hidden_size
        for j, item in enumerate(values):
            if item.ndim != 2 or not item.is_floating_point() or item.shape[0] < 1 or item.shape[1] != hidden:
                raise ValueError(
                    f"{where}[{j}]: image embeddings must be float tensors of shape [num_images, feature_size, "
                    f"{hidden}] or [feature_size, {hidden}] (the language model's hidden size), got {tuple(item.shape)}"
                )
        return values

    @property
    def hidden_size(self) -> int:
        return int(getattr(self.hf_config, "text_config", self.hf_config).hidden_size)

    def process(
        self,
        prompt: Any,
        mm_data: Any,
        mm_processor_kwargs: Any = None,
        add_special_tokens: bool = True,
        where: str = "prompt",
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """(prompt token ids, the items' features in prompt order). ValueError names what is wrong."""
        if not isinstance(prompt, str):
            raise ValueError(
                f"{where}: multi_modal_data needs a text 'prompt' (with one {self.image_placeholder!r} per image)"
            )
        if mm_processor_kwargs is not None and not isinstance(mm_processor_kwargs, dict):
            raise ValueError(f"{where}.mm_processor_kwargs={mm_processor_kwargs!r} must be a dict")
        kwargs = {**self.config.processor_kwargs, **(mm_processor_kwargs or {})}
        images = self.items(mm_data, where).get("image", [])
        found = prompt.count(self.image_placeholder)
        if found != len(images):
            raise ValueError(
                f"{where}: the prompt has {found} image placeholders {self.image_placeholder!r} for "
                f"{len(images)} images; give one placeholder per image"
            )
        if any(isinstance(im, torch.Tensor) for im in images):
            return self._process_embeddings(prompt, images, add_special_tokens, where)
        try:
            out = self.processor(
                text=[prompt],
                images=images or None,
                return_tensors="pt",
                add_special_tokens=add_special_tokens,
                **kwargs,
            )
        except Exception as e:  # whatever the processor raises on a bad item is the request's fault
            raise ValueError(f"{where}.multi_modal_data: the model's processor refused the input: {e}") from None
        ids = out["input_ids"][0].tolist()
        if not images:
            return ids, []
        return ids, self._features(ids, out, images, kwargs, where)

    def _process_embeddings(
        self, prompt: str, embeds: list[torch.Tensor], add_special_tokens: bool, where: str
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """Each placeholder expanded to its embedding's feature_size tokens; the embeddings stand for the encoder's
        output (multimodal/encoder_runner.py runs no encoder for them)."""
        pieces = prompt.split(self.image_placeholder)
        text = pieces[0] + "".join(self.image_placeholder * len(e) + p for e, p in zip(embeds, pieces[1:]))
        ids = self.processor.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        positions = np.flatnonzero(np.asarray(ids) == self.image_token_id)  # [total image tokens]
        if len(positions) != sum(len(e) for e in embeds):
            raise ValueError(f"{where}: the image placeholder {self.image_placeholder!r} is not one token")
        features, start = [], 0
        for e in embeds:
            data = {"image_embeds": e.detach()}  # [feature_size, hidden]
            identifier = hash_item("image_embeds", e, {})
            features.append(MultiModalFeature("image", identifier, int(positions[start]), len(e), data))
            start += len(e)
        return ids, features

    def _features(self, ids: list[int], out: Any, images: list, kwargs: dict, where: str) -> list[MultiModalFeature]:
        tensors = {k: v for k, v in out.items() if k not in _TEXT_KEYS and isinstance(v, torch.Tensor)}
        positions = np.flatnonzero(np.asarray(ids) == self.image_token_id)  # [total image tokens]
        n = len(images)
        if len(positions) % n:
            raise ValueError(f"{where}: {len(positions)} image tokens do not split evenly over {n} images")
        size = len(positions) // n
        features = []
        for i, image in enumerate(images):
            span = positions[i * size : (i + 1) * size]
            if span[-1] - span[0] != size - 1:
                raise ValueError(f"{where}: image {i}'s placeholder tokens are not contiguous")
            data = {k: v[i : i + 1] for k, v in tensors.items() if v.shape[0] == n}
            features.append(MultiModalFeature("image", hash_item("image", image, kwargs), int(span[0]), size, data))
        return features

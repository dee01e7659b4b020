"""Qwen2-VL / Qwen2.5-VL inputs: images through transformers' Qwen2-VL image processor (its PIL backend, which needs
no torchvision), videos patchified here the way transformers' Qwen2-VL video processor does it, and each
<|image_pad|> / <|video_pad|> placeholder expanded to the item's number of merged patches.

Dynamic resolution: an item is resized to multiples of patch_size * merge_size (28 pixels) within min_pixels and
max_pixels (the processor config's, or mm_processor_kwargs'), then cut into [t * h * w, C * T * P * P] patches."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import numpy as np
import torch

from pagedllm.multimodal.config import MultiModalConfig
from pagedllm.multimodal.hashing import hash_item
from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.multimodal.processor import MultiModalProcessor, check_item_size, is_image

IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
_VIDEO_DEFAULTS = {"min_pixels": 128 * 28 * 28, "max_pixels": 28 * 28 * 768}  # transformers' video processor
_SIZE_KWARGS = ("min_pixels", "max_pixels")
_KNOWN_KWARGS = (*_SIZE_KWARGS, "fps")


def _video_frames(item: Any) -> np.ndarray | None:
    """A video as frames [T, H, W, 3] uint8 (a numpy array or a list of PIL images / [H, W, 3] arrays); None if
    it is neither."""
    if isinstance(item, np.ndarray) and item.ndim == 4 and item.shape[-1] == 3:
        return item if item.dtype == np.uint8 and len(item) else None
    if isinstance(item, (list, tuple)) and item and all(is_image(f) or isinstance(f, np.ndarray) for f in item):
        frames = [np.asarray(f.convert("RGB")) if is_image(f) else f for f in item]
        if all(f.ndim == 3 and f.shape == frames[0].shape and f.shape[-1] == 3 for f in frames):
            stacked = np.stack(frames)
            return stacked if stacked.dtype == np.uint8 else None
    return None


class Qwen2VLProcessor(MultiModalProcessor):
    def __init__(
        self,
        model_path: str,
        hf_config: Any,
        modalities: tuple[str, ...],
        mm_config: MultiModalConfig,
        trust_remote_code: bool = False,
    ) -> None:
        from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

        self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_path)
        self.modalities = modalities
        self.config = mm_config
        self.hf_config = hf_config
        self.image_token_id = int(hf_config.image_token_id)
        self.video_token_id = int(hf_config.video_token_id)
        self.image_placeholder = f"<|vision_start|>{IMAGE_PAD}<|vision_end|>"  # (in chat string content)
        self.video_placeholder = f"<|vision_start|>{VIDEO_PAD}<|vision_end|>"
        vision = hf_config.vision_config
        self.merge = vision.spatial_merge_size
        self.tokens_per_second = getattr(vision, "tokens_per_second", None)  # Qwen2.5-VL: temporal positions
        self.video_settings = dict(_VIDEO_DEFAULTS)
        path = os.path.join(model_path, "video_preprocessor_config.json")
        if os.path.isfile(path):
            with open(path) as f:
                saved = json.load(f)
            size = saved.get("size") or {}
            self.video_settings["min_pixels"] = saved.get("min_pixels", size.get("shortest_edge", 128 * 28 * 28))
            self.video_settings["max_pixels"] = saved.get("max_pixels", size.get("longest_edge", 28 * 28 * 768))

    def items(self, mm_data: Any, where: str) -> dict[str, list]:
        if not isinstance(mm_data, dict):
            raise ValueError(f"{where}.multi_modal_data must be a dict like {{'image': image}}")
        videos = mm_data.get("video")
        given = mm_data.get("image")
        given = [given] if isinstance(given, dict) else given
        embeds = None
        if isinstance(given, (list, tuple)) and any(isinstance(e, dict) for e in given):  # enable_mm_embeds
            at = f"{where}.multi_modal_data['image']"
            if not all(isinstance(e, dict) for e in given):
                raise ValueError(f"{at}: give either images or image embeddings, not both")
            mm_data = {k: v for k, v in mm_data.items() if k != "image"}
            embeds = [item for e in given for item in self._grid_embeddings(e, at)]
        out = super().items({k: v for k, v in mm_data.items() if k != "video"}, where)
        if embeds is not None:
            self._check_limit("image", len(embeds), where)
            out["image"] = embeds
        if videos is None:
            return out
        if "video" not in self.modalities:
            raise ValueError(f"{where}.multi_modal_data: modality 'video' is not one the model takes")
        single = _video_frames(videos) is not None
        items = [videos] if single else list(videos) if isinstance(videos, (list, tuple)) else [videos]
        frames = []
        for j, item in enumerate(items):
            video = _video_frames(item)
            if video is None:
                raise ValueError(
                    f"{where}.multi_modal_data['video'][{j}] has type {type(item).__name__}; expected frames as a "
                    "[T, H, W, 3] uint8 numpy array or a list of PIL images"
                )
            check_item_size(video.shape[2], video.shape[1], f"{where}.multi_modal_data['video'][{j}]")
            frames.append(video)
        self._check_limit("video", len(frames), where)
        if frames:
            out["video"] = frames
        return out

    def _embeddings(self, value: Any, where: str) -> list | None:
        if any(isinstance(v, torch.Tensor) for v in (value if isinstance(value, (list, tuple)) else [value])):
            raise ValueError(
                f"{where}: Qwen2-VL's image embeddings come as {{'image_embeds': tensor, 'image_grid_thw': tensor "
                "[num_images, 3]}} (the grid places them with M-RoPE)"
            )
        return None

    def _grid_embeddings(self, value: dict, where: str) -> list[dict]:
        """One {"image_embeds": [length, hidden], "image_grid_thw": [1, 3]} per image from the whole prompt's
        embeddings ([total length, hidden] or [num_images, length, hidden]) and grids [num_images, 3] of patches."""
        if not self.config.enable_embeds:
            raise ValueError(f"{where}: image embeddings need the engine built with enable_mm_embeds=True")
        embeds, grids = value.get("image_embeds"), value.get("image_grid_thw")
        if set(value) != {"image_embeds", "image_grid_thw"} or not isinstance(embeds, torch.Tensor):
            raise ValueError(f"{where}: expected exactly the keys 'image_embeds' (a tensor) and 'image_grid_thw'")
        try:
            grids = torch.as_tensor(grids)
        except (TypeError, ValueError, RuntimeError):
            grids = torch.zeros(0)  # refused below
        integer = not grids.is_floating_point() and grids.dtype != torch.bool
        if grids.ndim != 2 or grids.shape[1] != 3 or not integer or not len(grids) or (grids < 1).any():
            raise ValueError(f"{where}['image_grid_thw'] must be integers >= 1 of shape [num_images, 3]")
        if ((grids[:, 1:] % self.merge) != 0).any():
            raise ValueError(f"{where}['image_grid_thw']: h and w must be multiples of {self.merge}")
        lengths = [int(g.prod()) // self.merge**2 for g in grids]
        hidden = int(self.hf_config.text_config.hidden_size)
        flat = embeds.reshape(-1, embeds.shape[-1]) if embeds.ndim == 3 else embeds  # [total length, hidden]
        if not embeds.is_floating_point() or flat.ndim != 2 or flat.shape != (sum(lengths), hidden):
            raise ValueError(
                f"{where}['image_embeds'] has shape {tuple(embeds.shape)}; its grids need [{sum(lengths)}, {hidden}]"
            )
        parts = torch.split(flat.detach(), lengths)
        return [{"image_embeds": e, "image_grid_thw": grids[i : i + 1].long()} for i, e in enumerate(parts)]

    def process(
        self,
        prompt: Any,
        mm_data: Any,
        mm_processor_kwargs: Any = None,
        add_special_tokens: bool = True,
        where: str = "prompt",
    ) -> tuple[list[int], list[MultiModalFeature]]:
        if not isinstance(prompt, str):
            raise ValueError(f"{where}: multi_modal_data needs a text 'prompt' (with one {IMAGE_PAD!r} per image)")
        if mm_processor_kwargs is not None and not isinstance(mm_processor_kwargs, dict):
            raise ValueError(f"{where}.mm_processor_kwargs={mm_processor_kwargs!r} must be a dict")
        kwargs = {**self.config.processor_kwargs, **(mm_processor_kwargs or {})}
        unknown = sorted(set(kwargs) - set(_KNOWN_KWARGS))
        if unknown:
            raise ValueError(f"{where}.mm_processor_kwargs: unknown keys {unknown}; allowed: {list(_KNOWN_KWARGS)}")
        items = self.items(mm_data, where)
        images, videos = items.get("image", []), items.get("video", [])
        for name, pad, given in (("image", IMAGE_PAD, images), ("video", VIDEO_PAD, videos)):
            if prompt.count(pad) != len(given):
                raise ValueError(
                    f"{where}: the prompt has {prompt.count(pad)} {name} placeholders {pad!r} for {len(given)} "
                    f"{name}s; give one placeholder per {name}"
                )
        try:
            encoded = [self._image(im, kwargs) for im in images] + [self._video(v, kwargs) for v in videos]
        except ValueError as e:  # bad sizes, an aspect ratio above 200
            raise ValueError(f"{where}: {e}") from None
        except Exception as e:  # whatever the image processor raises on a bad item is the request's fault
            raise ValueError(f"{where}.multi_modal_data: the item cannot be processed: {e}") from None
        for item, raw in zip(encoded, images + videos):
            item["identifier"] = hash_item(item["modality"], raw, kwargs)
        pieces = re.split(f"({re.escape(IMAGE_PAD)}|{re.escape(VIDEO_PAD)})", prompt)
        image_iter, video_iter = iter(encoded[: len(images)]), iter(encoded[len(images) :])
        order = []  # the encoded items in prompt order
        for k, piece in enumerate(pieces):
            if piece in (IMAGE_PAD, VIDEO_PAD):
                order.append(next(image_iter if piece == IMAGE_PAD else video_iter))
                pieces[k] = piece * order[-1]["length"]
        ids = self.tokenizer("".join(pieces), add_special_tokens=add_special_tokens)["input_ids"]
        return ids, self._features(ids, order, where)

    def _features(self, ids: list[int], order: list[dict], where: str) -> list[MultiModalFeature]:
        """Each item's placeholder span, found in prompt order (adjacent items of one kind split by length)."""
        features, cursor = [], 0
        for item in order:
            pad = self.video_token_id if item["modality"] == "video" else self.image_token_id
            while cursor < len(ids) and ids[cursor] != pad:
                cursor += 1
            span = ids[cursor : cursor + item["length"]]
            if len(span) != item["length"] or any(t != pad for t in span):
                raise ValueError(f"{where}: the {item['modality']} placeholder tokens are not contiguous")
            data, grid, interval = item["data"], item["grid"], item["time_interval"]
            features.append(
                MultiModalFeature(item["modality"], item["identifier"], cursor, item["length"], data, grid, interval)
            )
            cursor += item["length"]
        return features

    def _size(self, kwargs: dict, defaults: dict) -> dict:
        size = {k: kwargs.get(k, defaults[k]) for k in _SIZE_KWARGS}
        for key, value in size.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"mm_processor_kwargs[{key!r}]={value!r} must be an integer >= 1")
        if size["min_pixels"] > size["max_pixels"]:
            raise ValueError(f"min_pixels={size['min_pixels']} is above max_pixels={size['max_pixels']}")
        return size

    def _item(self, modality: str, data: dict, grid_thw: list[int], time_interval: float) -> dict:
        t, h, w = (int(g) for g in grid_thw)
        grid = (t, h // self.merge, w // self.merge)
        length = grid[0] * grid[1] * grid[2]
        return {"modality": modality, "data": data, "grid": grid, "length": length, "time_interval": time_interval}

    def _image(self, image: Any, kwargs: dict) -> dict:
        if isinstance(image, dict):  # precomputed embeddings: the encoder's output for its grid
            return self._item("image", image, image["image_grid_thw"][0].tolist(), 1)
        ip = self.image_processor
        size = self._size(kwargs, {"min_pixels": ip.size["shortest_edge"], "max_pixels": ip.size["longest_edge"]})
        size = {"shortest_edge": size["min_pixels"], "longest_edge": size["max_pixels"]}
        out = ip(images=[image], size=size, return_tensors="pt")
        grid = out["image_grid_thw"]  # [1, 3]
        return self._item("image", {"pixel_values": out["pixel_values"], "image_grid_thw": grid}, grid[0].tolist(), 1)

    def _video(self, frames: np.ndarray, kwargs: dict) -> dict:
        """frames [T, H, W, 3] -> patches as transformers' Qwen2-VL video processor makes them: each frame resized
        (bicubic) to the video's size, rescaled and normalized; T padded to the temporal patch by repeating the last
        frame; [grid_t * grid_h * grid_w, C * T * P * P] in the merge-block order."""
        from PIL import Image
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        ip = self.image_processor
        size = self._size(kwargs, self.video_settings)
        patch, temporal, merge = ip.patch_size, ip.temporal_patch_size, ip.merge_size
        height, width = smart_resize(frames.shape[1], frames.shape[2], patch * merge, *size.values())
        if (height, width) != frames.shape[1:3]:
            frames = np.stack([np.asarray(Image.fromarray(f).resize((width, height), Image.BICUBIC)) for f in frames])
        x = frames.astype(np.float32) * np.float32(ip.rescale_factor)
        x = (x - np.asarray(ip.image_mean, np.float32)) / np.asarray(ip.image_std, np.float32)
        x = torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))  # [T, C, H, W]
        if pad := -x.shape[0] % temporal:
            x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
        gt, gh, gw = x.shape[0] // temporal, height // patch, width // patch
        x = x.view(gt, temporal, 3, gh // merge, merge, patch, gw // merge, merge, patch)
        x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(gt * gh * gw, 3 * temporal * patch * patch)
        interval = 1.0
        if self.tokens_per_second is not None:  # Qwen2.5-VL: seconds per temporal patch at the video's fps
            fps = kwargs.get("fps", 2.0)
            if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0:
                raise ValueError(f"mm_processor_kwargs['fps']={fps!r} must be a number > 0")
            interval = self.tokens_per_second * temporal / fps
        grid = torch.tensor([[gt, gh, gw]])
        return self._item("video", {"pixel_values_videos": x, "video_grid_thw": grid}, [gt, gh, gw], interval)

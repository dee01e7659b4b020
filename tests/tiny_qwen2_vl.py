"""Tiny random Qwen2-VL and Qwen2.5-VL checkpoints (a vision transformer of 2 blocks, a Qwen2 LM of 2 layers with
M-RoPE) and transformers' processor as the oracle's: its Qwen2-VL image processor (PIL backend) saved with the
checkpoint, and Qwen2VLProcessor built around it for HF's side (its video processor needs torchvision, so the
processor is built without one and videos reach HF's model as patches)."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import torch
import transformers as T
from char_tokenizer import char_tokenizer
from tiny_models import TINY_DECODER, save_tiny_decoder

IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, START_ID, END_ID = 97, 98, 99, 100
SPECIAL = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
MIN_PIXELS, MAX_PIXELS = 28 * 28, 28 * 28 * 12  # 1 to 12 LM tokens per image
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{% if p.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p.type == 'video' %}<|vision_start|><|video_pad|><|vision_end|>{% else %}{{ p.text }}{% endif %}"
    "{% endfor %}"
    "{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
VISION = dict(depth=2, num_heads=4, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
ROPE = {"rope_type": "default", "mrope_section": [2, 3, 3]}  # of head_dim 16: 8 rotary frequencies
TEXT = dict(TINY_DECODER, vocab_size=128, bos_token_id=None, eos_token_id=None, rope_parameters=ROPE)


def qwen2_vl_config() -> T.Qwen2VLConfig:
    vision = dict(VISION, embed_dim=32, hidden_size=64, mlp_ratio=2)
    return T.Qwen2VLConfig(
        vision_config=vision,
        text_config=TEXT,
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=START_ID,
        vision_end_token_id=END_ID,
    )


def qwen2_5_vl_config() -> T.Qwen2_5_VLConfig:
    # windows of 2x2 merged patches (56 pixels), block 1 attends fully
    vision = dict(VISION, hidden_size=32, intermediate_size=48, out_hidden_size=64, window_size=56)
    vision.update(fullatt_block_indexes=[1], tokens_per_second=2, hidden_act="silu")
    return T.Qwen2_5_VLConfig(
        vision_config=vision,
        text_config=TEXT,
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=START_ID,
        vision_end_token_id=END_ID,
    )


def image(seed: int, size: tuple[int, int] = (40, 50)):
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def video(seed: int, num_frames: int = 3, size: tuple[int, int] = (56, 28)) -> np.ndarray:
    """Frames [T, H, W, 3] at a size the processor keeps (multiples of 28 within the pixel bounds)."""
    return np.random.RandomState(seed).randint(0, 256, (num_frames, *size, 3), dtype=np.uint8)


def mp4_data_url(frames: np.ndarray) -> str:
    """The frames encoded as MPEG-4 video (lossy) in a data: URL."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return "data:video/mp4;base64," + base64.b64encode(buf.getvalue()).decode()


def hf_processor(path: str) -> T.Qwen2VLProcessor:
    tok = T.AutoTokenizer.from_pretrained(path)
    images = T.Qwen2VLImageProcessorPil.from_pretrained(path)
    # (transformers refuses a processor without its torchvision video processor; images need none)
    check = T.Qwen2VLProcessor.check_argument_for_proper_class
    T.Qwen2VLProcessor.check_argument_for_proper_class = lambda *args: None
    try:
        return T.Qwen2VLProcessor(image_processor=images, tokenizer=tok, video_processor=None)
    finally:
        T.Qwen2VLProcessor.check_argument_for_proper_class = check


def hf_generate(hf, processor, prompt: str, images: list, max_tokens: int, videos: list | None = None) -> list[int]:
    """HF's greedy tokens. Videos: HF's model gets the patches and grids pagedllm's processor made (the video
    processor of transformers needs torchvision); placeholders are expanded here as transformers does."""
    extra = {}
    if videos:  # each video's tokens stand as '#' through the processor (which refuses video tokens without videos)
        assert "#" not in prompt
        pv, grids = videos
        merge = hf.config.vision_config.spatial_merge_size
        for grid in grids:
            prompt = prompt.replace("<|video_pad|>", "#" * int(grid.prod() // merge**2), 1)
        extra = {"pixel_values_videos": pv, "video_grid_thw": grids}
    inputs = processor(text=[prompt], images=images or None, return_tensors="pt")
    if videos:
        is_video = inputs["input_ids"] == processor.tokenizer.convert_tokens_to_ids("#")
        inputs["input_ids"] = torch.where(is_video, VIDEO_TOKEN_ID, inputs["input_ids"])
        inputs["mm_token_type_ids"] = torch.where(is_video, 2, inputs["mm_token_type_ids"])
    with torch.no_grad():
        out = hf.generate(**inputs, **extra, max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


# name (it seeds the weights: these give greedy tokens that differ with each image) -> (config, HF class)
ARCHS = {
    "qwen2_vl": (qwen2_vl_config, T.Qwen2VLForConditionalGeneration),
    "q25": (qwen2_5_vl_config, T.Qwen2_5_VLForConditionalGeneration),
}


def save_tiny_qwen2_vl(tmp_path_factory, name: str = "qwen2_vl"):
    """(HF model, its processor, the checkpoint folder)."""
    make_config, model_cls = ARCHS[name]
    hf, path = save_tiny_decoder(name, lambda **_: make_config(), model_cls, {}, tmp_path_factory)
    with torch.no_grad():  # image features as large as the text's: each image changes the greedy tokens
        hf.model.visual.merger.mlp[2].weight.mul_(30.0)
    hf.save_pretrained(path)
    tok = char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    assert tok.convert_tokens_to_ids(SPECIAL) == [IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, START_ID, END_ID]
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    T.Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(path)
    video_config = {"video_processor_type": "Qwen2VLVideoProcessor", "temporal_patch_size": 2}
    video_config["size"] = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    (Path(path) / "video_preprocessor_config.json").write_text(json.dumps(video_config))
    return hf, hf_processor(str(path)), str(path)

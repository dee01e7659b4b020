"""A tiny random LLaVA (a CLIP tower of 3 layers, of which LLaVA reads 2, at 28x28 pixels; a Llama of 2 layers) and
its real processor: CLIPImageProcessor and the character-level test tokenizer with an <image> token (4 placeholder
tokens per image)."""

from __future__ import annotations

import numpy as np
import torch
import transformers as T
from char_tokenizer import char_tokenizer
from tiny_models import TINY_DECODER, save_tiny_decoder

IMAGE_TOKEN = "<image>"
IMAGE_TOKEN_ID = 97  # the char tokenizer's first free id
NUM_IMAGE_TOKENS = 4  # (28 / 14) ** 2 patches, the class token dropped
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{% if p.type == 'image' %}<image>{% else %}{{ p.text }}{% endif %}{% endfor %}"
    "{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def image(seed: int, size: tuple[int, int] = (40, 50)):
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def llava_config(text_cls=T.LlamaConfig, **kwargs) -> T.LlavaConfig:
    vision = T.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=28,
        patch_size=14,
        projection_dim=32,
    )
    text = text_cls(**dict(TINY_DECODER, vocab_size=128))
    return T.LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN_ID, **kwargs)


def llava_processor(strategy: str = "default") -> T.LlavaProcessor:
    tok = char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tok.chat_template = CHAT_TEMPLATE
    images = T.CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    return T.LlavaProcessor(
        image_processor=images,
        tokenizer=tok,
        patch_size=14,
        vision_feature_select_strategy=strategy,
        image_token=IMAGE_TOKEN,
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )


def hf_generate(hf, processor, prompt: str, images: list, max_tokens: int) -> list[int]:
    """HF's greedy tokens for one prompt with its images."""
    inputs = processor(text=[prompt], images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def save_tiny_llava(tmp_path_factory, name: str = "llava", text_cls=T.LlamaConfig, strategy: str = "default", **kwargs):
    """(HF model, its processor, the checkpoint folder with both saved). kwargs: LlavaConfig fields."""
    config = llava_config(text_cls, vision_feature_select_strategy=strategy, **kwargs)
    hf, path = save_tiny_decoder(name, lambda **_: config, T.LlavaForConditionalGeneration, {}, tmp_path_factory)
    with torch.no_grad():  # image features as large as the text's: each image changes the greedy tokens
        hf.model.multi_modal_projector.linear_2.weight.mul_(30.0)
    hf.save_pretrained(path)
    processor = llava_processor(strategy)
    processor.save_pretrained(path)
    assert processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN) == IMAGE_TOKEN_ID
    return hf, processor, path

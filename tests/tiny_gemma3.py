"""A tiny random Gemma3ForConditionalGeneration (a SigLIP tower of 2 layers at 56x56 pixels, 4x4 patches pooled to
2x2 = 4 tokens an image; a Gemma 3 LM of 2 layers by default, sliding-window and global in turn) and its real processor:
Gemma3Processor with the PIL Gemma3 image processor and the character-level test tokenizer with Gemma 3's
<start_of_image>, <end_of_image> and <image_soft_token>."""

from __future__ import annotations

import numpy as np
import torch
import transformers as T
from char_tokenizer import char_tokenizer
from tiny_models import TINY_DECODER

BOI, EOI, IMAGE_TOKEN = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
BOI_ID, EOI_ID, IMAGE_TOKEN_ID = 97, 98, 99  # the char tokenizer's first free ids
NUM_IMAGE_TOKENS = 4
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{% if p.type == 'image' %}<start_of_image>{% else %}{{ p.text }}{% endif %}"
    "{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
TEXT = dict(
    TINY_DECODER,
    vocab_size=128,
    head_dim=16,
    sliding_window=6,  # shorter than the prompts: the window cuts into the image's bidirectional block
    layer_types=["sliding_attention", "full_attention"],
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000.0},
    },
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)
VISION = dict(
    hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=56, patch_size=14
)


def image(seed: int, size: tuple[int, int] = (40, 50)):
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def gemma3_processor() -> T.Gemma3Processor:
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tok = char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [BOI, EOI, IMAGE_TOKEN]})
    tok = T.PreTrainedTokenizerFast(
        tokenizer_object=tok._tokenizer,
        eos_token="</s>",
        extra_special_tokens={"boi_token": BOI, "eoi_token": EOI, "image_token": IMAGE_TOKEN},
        chat_template=CHAT_TEMPLATE,
    )
    images = Gemma3ImageProcessorPil(size={"height": 56, "width": 56})
    processor = T.Gemma3Processor(
        image_processor=images, tokenizer=tok, image_seq_length=NUM_IMAGE_TOKENS, chat_template=CHAT_TEMPLATE
    )
    assert [tok.boi_token_id, tok.eoi_token_id, tok.image_token_id] == [BOI_ID, EOI_ID, IMAGE_TOKEN_ID]
    return processor


def hf_generate(hf, processor, prompt: str, images: list, max_tokens: int) -> list[int]:
    """HF's greedy tokens for one prompt with its images (token_type_ids: the bidirectional image mask)."""
    inputs = processor(text=[prompt], images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def save_tiny_gemma3(tmp_path_factory, name: str = "gemma3-vl", num_layers: int = 2):
    """(HF model, its processor, the checkpoint folder with both saved). num_layers: the LM's, sliding-window and
    global in turn (the last layer's image mask changes only the image rows' final states, never a sampled token:
    a test of the mask in a later pipeline stage needs a layer there before the last)."""
    torch.manual_seed(34)
    layer_types = ["sliding_attention", "full_attention"] * (num_layers // 2) + ["sliding_attention"] * (num_layers % 2)
    config = T.Gemma3Config(
        text_config=T.Gemma3TextConfig(**dict(TEXT, num_hidden_layers=num_layers, layer_types=layer_types)),
        vision_config=T.SiglipVisionConfig(**VISION),
        mm_tokens_per_image=NUM_IMAGE_TOKENS,
        boi_token_index=BOI_ID,
        eoi_token_index=EOI_ID,
        image_token_index=IMAGE_TOKEN_ID,
    )
    hf = T.Gemma3ForConditionalGeneration(config).eval()
    hf.generation_config.eos_token_id = None
    with torch.no_grad():  # norm weights start at 0 (Gemma's 1 + w): randomize them so that they matter
        for param_name, p in hf.named_parameters():
            if "norm" in param_name and "vision_tower" not in param_name:
                p.normal_(0.0, 0.3)
            if "q_norm" in param_name or "k_norm" in param_name:  # sharper attention: the image mask shows
                p.normal_(2.0, 0.3)
        # image tokens as large as the text's (each image changes the greedy tokens)
        hf.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.05)
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    processor = gemma3_processor()
    processor.save_pretrained(path)
    return hf, processor, str(path)

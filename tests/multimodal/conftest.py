"""The tiny LLaVA checkpoint (tests/tiny_llava.py), saved once per session."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from tiny_llava import IMAGE_TOKEN, IMAGE_TOKEN_ID, llava_config, llava_processor
from tiny_models import save_tiny_decoder


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory):
    """(HF model, its processor, the checkpoint folder)."""
    hf, path = save_tiny_decoder(
        "llava", lambda **_: llava_config(), T.LlavaForConditionalGeneration, {}, tmp_path_factory
    )
    with torch.no_grad():  # image features as large as the text's: each image changes the greedy tokens
        hf.model.multi_modal_projector.linear_2.weight.mul_(30.0)
    hf.save_pretrained(path)
    processor = llava_processor()
    processor.save_pretrained(path)
    assert processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN) == IMAGE_TOKEN_ID
    return hf, processor, path

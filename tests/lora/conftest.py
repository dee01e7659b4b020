"""Tiny random base models with PEFT adapters made by the peft package (random non-zero B), and the oracle: PEFT's
own merged model in HF transformers."""

from __future__ import annotations

import zlib

import pytest
import torch
from tiny_models import TINY_DECODER, save_tiny_decoder

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> LoraConfig keywords and whether it is saved as a .bin: each exercises another part of the layout
ADAPTERS = {
    "all": (dict(r=8, lora_alpha=16, target_modules=ALL_TARGETS), False),
    "qv-rslora": (dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]), True),
    "mlp-r16": (dict(r=16, lora_alpha=8, target_modules=["o_proj", "gate_proj", "down_proj"]), False),
    "patterns": (
        dict(
            r=8,
            lora_alpha=16,
            target_modules=["k_proj", "up_proj"],
            rank_pattern={"up_proj": 2},
            alpha_pattern={"k_proj": 4},
        ),
        False,
    ),  # fmt: skip
}
ARCHS = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}


def make_adapter(base_path: str, name: str, out_dir, seed: int, lora_kwargs: dict, as_bin: bool):
    """Saves a PEFT adapter on the base with random B (PEFT starts B at zero); returns (folder, merged HF model)."""
    # imported here, not at collection: peft imports triton, which must come after tests/kernels switches on
    # Triton's CPU interpreter
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(**lora_kwargs))
    torch.manual_seed(seed)
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if "lora_A" in param_name or "lora_B" in param_name:
                p.normal_(0.0, 0.3 if "lora_B" in param_name else 0.15)
    path = str(out_dir / name)
    model.save_pretrained(path, safe_serialization=not as_bin)
    merged = model.merge_and_unload().eval()
    merged.generation_config.eos_token_id = None
    return path, merged


@pytest.fixture(scope="session", params=list(ARCHS))
def lora_family(request, tmp_path_factory):
    """(arch, base folder, base HF model, {adapter name: (folder, merged HF model)})."""
    import transformers

    pytest.importorskip("peft")

    arch = request.param
    config_cls, model_cls = (getattr(transformers, n) for n in ARCHS[arch])
    hf, base_path = save_tiny_decoder(f"lora-{arch}", config_cls, model_cls, TINY_DECODER, tmp_path_factory)
    out_dir = tmp_path_factory.mktemp(f"adapters-{arch}")
    adapters = {
        name: make_adapter(base_path, name, out_dir, zlib.crc32(f"{arch}/{name}".encode()), kwargs, as_bin)
        for name, (kwargs, as_bin) in ADAPTERS.items()
    }
    return arch, base_path, hf, adapters

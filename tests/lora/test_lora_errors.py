"""Bad LoRA input is refused with a ValueError naming it, before any request enters the engine, and the engine
keeps serving: LoRA off, a missing folder, a rank above max_lora_rank, target modules the base lacks, another base
model, an id reused for another folder, DoRA, modules_to_save, added vocabulary."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from pagedllm import LLM, LoRARequest, SamplingParams

SP = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
PROMPT = [{"prompt_token_ids": [5, 6, 7]}]


@pytest.fixture(scope="module")
def rank8_llm(lora_family):
    _, base_path, _, _ = lora_family
    return LLM(
        base_path, dtype="float32", device="cpu", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 21,
        enable_lora=True, max_loras=1, max_lora_rank=8,
    )  # fmt: skip


def edit_adapter_config(src: str, dst, **changes) -> str:
    """A copy of adapter folder src with adapter_config.json fields changed (None: removed)."""
    shutil.copytree(src, dst)
    file = os.path.join(dst, "adapter_config.json")
    with open(file) as f:
        config = json.load(f)
    config.update(changes)
    with open(file, "w") as f:
        json.dump(config, f)
    return str(dst)


def write_adapter(path, tensors: dict[str, torch.Tensor], **config) -> str:
    os.makedirs(path)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": 4, "lora_alpha": 8, **config}, f)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    return str(path)


def refused(llm, lora: LoRARequest, *words: str) -> None:
    with pytest.raises(ValueError) as err:
        llm.generate(PROMPT * 2, SP, use_tqdm=False, lora_request=[None, lora])
    for word in words:
        assert word in str(err.value), (word, str(err.value))
    assert not llm.llm_engine.has_unfinished_requests()


def test_bad_adapters_are_refused_and_the_engine_keeps_serving(lora_family, rank8_llm, tmp_path):
    _, _, _, adapters = lora_family
    good = adapters["all"][0]
    refused(rank8_llm, LoRARequest("missing", 1, str(tmp_path / "nope")), "lora_path", "no such folder")
    refused(rank8_llm, LoRARequest("big", 2, adapters["mlp-r16"][0]), "r=16", "max_lora_rank=8")
    foo = edit_adapter_config(good, tmp_path / "foo", target_modules=["q_proj", "foo_proj"])
    refused(rank8_llm, LoRARequest("foo", 3, foo), "foo_proj", "not linear layers")
    dora = edit_adapter_config(good, tmp_path / "dora", use_dora=True)
    refused(rank8_llm, LoRARequest("dora", 4, dora), "use_dora", "DoRA")
    saved = edit_adapter_config(good, tmp_path / "saved", modules_to_save=["lm_head"])
    refused(rank8_llm, LoRARequest("saved", 5, saved), "modules_to_save")
    vocab = edit_adapter_config(good, tmp_path / "vocab")
    save_file({"x": torch.zeros(1)}, os.path.join(vocab, "new_embeddings.safetensors"))
    refused(rank8_llm, LoRARequest("vocab", 6, vocab), "new_embeddings", "vocabulary")
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    other_base = write_adapter(
        tmp_path / "other", {f"{prefix}.lora_A.weight": torch.ones(4, 32), f"{prefix}.lora_B.weight": torch.ones(64, 4)}
    )
    refused(rank8_llm, LoRARequest("other", 7, other_base), "q_proj", "another base model")
    odd = "base_model.model.model.layers.0.self_attn.rotary"
    no_layer = write_adapter(
        tmp_path / "odd", {f"{odd}.lora_A.weight": torch.ones(4, 64), f"{odd}.lora_B.weight": torch.ones(64, 4)}
    )
    refused(rank8_llm, LoRARequest("odd", 8, no_layer), "self_attn.rotary", "not a linear layer")
    assert rank8_llm.generate(PROMPT, SP, use_tqdm=False, lora_request=LoRARequest("good", 9, good))[0].finished
    refused(rank8_llm, LoRARequest("again", 9, adapters["patterns"][0]), "lora_int_id=9", "already used")
    with pytest.raises(ValueError, match="lora_request has 1 entries but there are 2 prompts"):
        rank8_llm.generate(PROMPT * 2, SP, use_tqdm=False, lora_request=[None])
    assert len(rank8_llm.generate(PROMPT, SP, use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_lora_request_fields_and_lora_off(lora_family):
    with pytest.raises(ValueError, match="lora_int_id=0"):
        LoRARequest("a", 0, "/x")
    with pytest.raises(ValueError, match="lora_path"):
        LoRARequest("a", 1, "")
    _, base_path, _, adapters = lora_family
    llm = LLM(base_path, dtype="float32", device="cpu", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 21)
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate(PROMPT, SP, use_tqdm=False, lora_request=LoRARequest("a", 1, adapters["all"][0]))
    with pytest.raises(ValueError, match="max_cpu_loras=1"):
        LLM(base_path, device="cpu", skip_tokenizer_init=True, enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="max_lora_rank=0"):
        LLM(base_path, device="cpu", skip_tokenizer_init=True, enable_lora=True, max_lora_rank=0)

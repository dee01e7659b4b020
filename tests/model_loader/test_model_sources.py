"""Where models come from (local dir, .gguf, HF cache, default) and the weight formats (safetensors, .bin, dummy)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from pagedllm import LLM, SamplingParams
from pagedllm.model_loader.resolve import resolve_model

CONFIG = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=128,
)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = {"prompt_token_ids": [3, 14, 15, 92, 65]}


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    model.generation_config.eos_token_id = None
    return model


def _reference(model) -> list[int]:
    ids = torch.tensor([PROMPT["prompt_token_ids"]])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0
        )
    return out[0, ids.shape[1] :].tolist()


def _generate(path: str, **kwargs) -> list[int]:
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22, **kwargs)
    return llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_safetensors_and_bin_load_the_same_model(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path / "st")
    hf_model.config.save_pretrained(tmp_path / "bin")  # a PyTorch .bin checkpoint, as older repos ship
    torch.save(hf_model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    ref = _reference(hf_model)
    assert _generate(str(tmp_path / "st")) == ref
    assert _generate(str(tmp_path / "bin")) == ref


def test_repo_id_found_in_local_hf_cache(hf_model, tmp_path, monkeypatch):
    snapshot = tmp_path / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / "abc123"
    hf_model.save_pretrained(snapshot)
    (tmp_path / "hub" / "models--tiny-org--tiny-llama" / "refs").mkdir()
    (tmp_path / "hub" / "models--tiny-org--tiny-llama" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model("tiny-org/tiny-llama") == str(snapshot)
    assert _generate("tiny-org/tiny-llama") == _reference(hf_model)


def test_dummy_weights_from_config_alone(tmp_path):
    config = dict(CONFIG, architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=8)
    (tmp_path / "config.json").write_text(json.dumps(config))
    tokens = _generate(str(tmp_path), load_format="dummy")
    assert len(tokens) == 6 and all(0 <= t < 128 for t in tokens)


def test_hf_overrides_dict_and_callable(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)
    llm = LLM(
        str(tmp_path), skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22, hf_overrides={"rms_norm_eps": 0.25}
    )
    assert llm.llm_engine.config.model.hf_config.rms_norm_eps == 0.25
    assert llm.llm_engine.core.executor.runner.model.model.norm.eps == 0.25
    llm = LLM(
        str(tmp_path),
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=1 << 22,
        hf_overrides=lambda c: setattr(c, "rms_norm_eps", 0.5) or c,
    )
    assert llm.llm_engine.core.executor.runner.model.model.norm.eps == 0.5


def test_default_model_and_tokenizer_override(smollm2, hf_model, tmp_path):
    assert resolve_model(None) == smollm2
    assert resolve_model(os.path.dirname(smollm2)) == smollm2  # a directory holding one .gguf file
    hf_model.save_pretrained(tmp_path)  # no tokenizer files: the tokenizer comes from the GGUF
    llm = LLM(str(tmp_path), tokenizer=smollm2, kv_cache_memory_bytes=1 << 22)
    assert llm.get_tokenizer().convert_ids_to_tokens(llm.get_tokenizer().eos_token_id) == "<|im_end|>"


def test_errors_name_the_model(tmp_path):
    with pytest.raises(ValueError, match="nothing-here"):
        resolve_model(str(tmp_path / "nothing-here"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(tmp_path / "empty"))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model(str(tmp_path / "notes.txt"))


def test_missing_shard_of_a_merged_projection_is_an_error(hf_model, tmp_path):
    from safetensors.torch import save_file

    hf_model.config.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items() if "layers.1.self_attn.k_proj" not in k}
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="k_proj|qkv_proj"):
        _generate(str(tmp_path))


def test_other_files_beside_the_checkpoint_are_ignored(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)
    torch.save({"learning_rate": 1.0}, tmp_path / "training_args.bin")
    torch.save({"unrelated": torch.zeros(2)}, tmp_path / "consolidated.pt")
    assert _generate(str(tmp_path)) == _reference(hf_model)


def test_generation_config_eos_ids_stop_generation(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)
    free = _generate(str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [127, free[2]]}))
    llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0]
    stop_at = free.index(free[2])
    assert out.token_ids == free[: stop_at + 1] and out.finish_reason == "stop"


def test_generation_config_sampling_defaults(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "max_new_tokens": 3, "repetition_penalty": 1.5})
    )
    llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens, defaults.repetition_penalty) == (0.0, 3, 1.5)
    implicit = llm.generate(PROMPT, use_tqdm=False)[0].outputs[0].token_ids
    explicit = SamplingParams(temperature=0.0, max_tokens=3, repetition_penalty=1.5)
    assert implicit == llm.generate(PROMPT, explicit, use_tqdm=False)[0].outputs[0].token_ids
    plain = LLM(str(tmp_path), skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22, generation_config="vllm")
    assert plain.get_default_sampling_params().max_tokens == 16

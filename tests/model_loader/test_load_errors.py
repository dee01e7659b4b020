"""Engine options and model folders that cannot run get a clear ValueError before any weight loads: the device, a
quantized checkpoint, a load_format without its files, a tokenizer folder, a max_model_len beyond the model's; a
folder of tokenizer files alone serves as `tokenizer=`."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import transformers

from pagedllm import LLM, SamplingParams

CONFIG = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=128,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny")
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).save_pretrained(path)
    return path


def tiny_llm(path, **kwargs) -> LLM:
    kwargs.setdefault("skip_tokenizer_init", True)
    return LLM(str(path), dtype="float32", kv_cache_memory_bytes=1 << 22, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA torch runs device='cuda'")
def test_cuda_on_a_cpu_only_torch(model_dir):
    with pytest.raises(ValueError, match=r"device='cuda'.*no CUDA GPU.*device='cpu'"):
        tiny_llm(model_dir, device="cuda")


@pytest.mark.parametrize("device", ["tpu", "not a device", "mps", 3])
def test_devices_that_pagedllm_does_not_run_on(model_dir, device):
    with pytest.raises(ValueError, match=rf"device={device!r}.*allowed 'auto', 'cpu', 'cuda' or 'cuda:N'"):
        tiny_llm(model_dir, device=device)


@pytest.mark.parametrize(
    "quant",
    [
        {"quant_method": "aqlm", "in_group_size": 8, "nbits_per_codebook": 16, "num_codebooks": 1},
        {"quant_method": "hqq", "nbits": 4, "group_size": 64},
        {"quant_method": "eetq", "weights": "int8"},
    ],
)
def test_quantized_checkpoint_is_refused_before_loading(tmp_path, quant):
    config = dict(CONFIG, architectures=["LlamaForCausalLM"], model_type="llama", quantization_config=quant)
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"not read")  # never opened: the check comes first
    with pytest.raises(ValueError, match=rf"quant_method='{quant['quant_method']}'.*not supported yet"):
        tiny_llm(tmp_path)


def test_load_format_without_its_files_names_the_files_found(model_dir):
    with pytest.raises(ValueError, match=r"load_format='pt'.*found: \['model.safetensors'\]"):
        tiny_llm(model_dir, load_format="pt")
    with pytest.raises(ValueError, match=r"load_format='gguf'.*found: \['model.safetensors'\]"):
        tiny_llm(model_dir, load_format="gguf")


def test_a_folder_of_tokenizer_files_alone_is_a_tokenizer(model_dir, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(["hello", "world", "a", "b"])}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    llm = tiny_llm(model_dir, tokenizer=str(tmp_path / "tok"), skip_tokenizer_init=False)
    out = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert out[0].prompt_token_ids == [1, 2] and len(out[0].outputs[0].token_ids) == 3
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"tokenizer='.*empty' is a directory without tokenizer files"):
        tiny_llm(model_dir, tokenizer=str(tmp_path / "empty"), skip_tokenizer_init=False)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"tokenizer='.*broken': no tokenizer could be loaded"):
        tiny_llm(model_dir, tokenizer=str(tmp_path / "broken"), skip_tokenizer_init=False)


def test_max_model_len_beyond_the_model_needs_the_environment_variable(model_dir, monkeypatch):
    for name in ("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN"):
        monkeypatch.delenv(name, raising=False)
    assert tiny_llm(model_dir, max_model_len=128).llm_engine.config.model.max_model_len == 128
    with pytest.raises(
        ValueError, match=r"max_model_len=129 is out of range: \[1, 128\].*VLLM_ALLOW_LONG_MAX_MODEL_LEN"
    ):
        tiny_llm(model_dir, max_model_len=129)
    for name in ("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN"):
        with monkeypatch.context() as env:
            env.setenv(name, "1")
            assert tiny_llm(model_dir, max_model_len=200).llm_engine.config.model.max_model_len == 200


def test_rope_scaling_factor_stretches_the_longest_max_model_len(tmp_path):
    rope = {"rope_type": "linear", "factor": 2.0}
    config = dict(CONFIG, architectures=["LlamaForCausalLM"], model_type="llama", rope_scaling=rope)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert tiny_llm(tmp_path, load_format="dummy", max_model_len=256).llm_engine.config.model.max_model_len == 256
    with pytest.raises(ValueError, match=r"max_model_len=257 is out of range: \[1, 256\]"):
        tiny_llm(tmp_path, load_format="dummy", max_model_len=257)


def test_a_missing_gguf_package_says_how_to_install_it(smollm2, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf fails
    monkeypatch.delitem(sys.modules, "pagedllm.model_loader.gguf_loader", raising=False)
    with pytest.raises(ModuleNotFoundError, match=r"needs the gguf package: pip install 'gguf>=0.10'"):
        LLM()

"""Models by repo id: downloaded from a (local, fake) Hugging Face Hub through HF_ENDPOINT, only the files the
engine reads; then found offline in the cache; clear errors for a missing repo, revision or ModelScope package."""

from __future__ import annotations

import os
import shutil

import huggingface_hub
import pytest
import torch
import transformers
from fake_hub import FakeHub
from tiny_models import TINY_DECODER, save_tiny_decoder

from pagedllm import LLM, SamplingParams
from pagedllm.model_loader.resolve import resolve_model


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    hf, main = save_tiny_decoder("hub", transformers.LlamaConfig, transformers.LlamaForCausalLM, TINY_DECODER,
                                 tmp_path_factory)  # fmt: skip
    torch.save(hf.state_dict(), os.path.join(main, "pytorch_model.bin"))  # a second format: not downloaded
    os.makedirs(os.path.join(main, "original"))
    open(os.path.join(main, "original", "consolidated.safetensors"), "wb").write(b"x" * 64)
    v2 = str(tmp_path_factory.mktemp("hub-v2"))
    shutil.copy(os.path.join(main, "config.json"), v2)
    open(os.path.join(v2, "model.safetensors"), "wb").write(b"v2")
    gguf = str(tmp_path_factory.mktemp("hub-gguf"))
    for quant in ("Q4_K_M", "Q8_0"):
        open(os.path.join(gguf, f"tiny.{quant}.gguf"), "wb").write(quant.encode())
    repos = {"org/tiny": {"main": main, "v2": v2}, "org/tiny-GGUF": {"main": gguf}}
    return hf, repos


def _online(monkeypatch) -> None:
    """Online mode (the test session is offline; huggingface_hub reads the variable once, at import)."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("PAGEDLLM_HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def hub(repos, tmp_path, monkeypatch):
    _online(monkeypatch)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "default-cache"))
    with FakeHub(repos[1]) as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        yield fake


def test_download_then_offline(repos, hub, tmp_path, monkeypatch):
    hf, _ = repos
    cache = str(tmp_path / "dl")
    llm = LLM("org/tiny", download_dir=cache, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22)
    path = llm.llm_engine.config.model.model_path
    assert path.startswith(cache) and sorted(os.listdir(path)) == ["config.json", "generation_config.json",
                                                                    "model.safetensors"]  # fmt: skip
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, pad_token_id=0)
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": ids[0].tolist()}, greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert out == ref[0, 5:].tolist()
    hub.__exit__()  # the Hub is gone: offline, the cache answers (by branch name and by commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("org/tiny", download_dir=cache) == path
    assert resolve_model("org/tiny", FakeHub.commit("main"), download_dir=cache) == path
    with pytest.raises(ValueError, match="'org/other' was not found.*HF_HUB_OFFLINE is set"):
        resolve_model("org/other", download_dir=cache)


def test_revision_gguf_quant_and_tokenizer_only(hub, tmp_path):
    v2 = resolve_model("org/tiny", revision="v2")
    assert v2.startswith(os.environ["HF_HUB_CACHE"])  # the cache the variable names now, not at import
    assert v2.endswith(FakeHub.commit("v2")) and open(os.path.join(v2, "model.safetensors")).read() == "v2"
    tok = resolve_model("org/tiny", tokenizer_only=True)  # main, without weights
    assert sorted(os.listdir(tok)) == ["config.json", "generation_config.json"]
    skipped = resolve_model("org/tiny", download_dir=str(tmp_path), ignore_patterns="generation_*")
    assert sorted(os.listdir(skipped)) == ["config.json", "model.safetensors"]
    q8 = resolve_model("org/tiny-GGUF:Q8_0")
    assert q8.endswith("tiny.Q8_0.gguf") and os.listdir(os.path.dirname(q8)) == ["tiny.Q8_0.gguf"]
    q4 = resolve_model("org/tiny-GGUF:q4_k_m")  # Q8_0 is cached: Q4_K_M is downloaded beside it
    assert q4.endswith("tiny.Q4_K_M.gguf") and sorted(os.listdir(os.path.dirname(q4))) == sorted(hub.files(
        hub.repos["org/tiny-GGUF"]["main"]))  # fmt: skip
    with pytest.raises(ValueError, match=r"holds 2 GGUF files.*'org/tiny-GGUF:<QUANT>'"):
        resolve_model("org/tiny-GGUF")


def test_missing_repo_revision_token_and_modelscope(repos, tmp_path, monkeypatch):
    with FakeHub(repos[1], token="secret") as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        _online(monkeypatch)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        with pytest.raises(ValueError, match=r"'org/tiny' was not found.*not on the Hub.*HF_TOKEN"):
            LLM("org/tiny", download_dir=str(tmp_path))
        with pytest.raises(ValueError, match="'org/tiny' has no revision 'v3'"):
            resolve_model("org/tiny", revision="v3", download_dir=str(tmp_path), token="secret")  # hf_token=
        assert hub.requests[-1][2] == "Bearer secret"
        monkeypatch.setenv("HF_TOKEN", "secret")
        assert resolve_model("org/tiny", download_dir=str(tmp_path)).startswith(str(tmp_path))
    import httpx2

    def unreachable(*args, **kwargs):
        raise httpx2.ConnectError("Name or service not known")

    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", unreachable)
    with pytest.raises(ValueError, match=r"'org/tiny' was not found locally and the Hub .* is not reachable"):
        resolve_model("org/tiny", download_dir=str(tmp_path / "empty"))
    monkeypatch.setenv("VLLM_USE_MODELSCOPE", "1")
    monkeypatch.setitem(__import__("sys").modules, "modelscope", None)  # not installed
    with pytest.raises(ValueError, match="VLLM_USE_MODELSCOPE=1 .* `modelscope` package"):
        resolve_model("org/elsewhere", download_dir=str(tmp_path))


def test_modelscope_download_plumbing(tmp_path, monkeypatch):
    """VLLM_USE_MODELSCOPE=1 lists the repo with modelscope's HubApi and downloads the same file choice (a stand-in
    package here: modelscope is not installed)."""
    import sys
    import types

    calls = {}

    class HubApi:
        def get_model_files(self, model_id, revision, recursive):
            calls["list"] = (model_id, revision, recursive)
            return [{"Path": p, "Type": "blob"} for p in ("config.json", "model.safetensors", "pytorch_model.bin")]

    def snapshot_download(model_id, revision, cache_dir, allow_patterns):
        calls["download"] = (model_id, revision, cache_dir, allow_patterns)
        return str(tmp_path / "ms")

    for name, attrs in (("modelscope", {}), ("modelscope.hub", {}), ("modelscope.hub.api", {"HubApi": HubApi}),
                        ("modelscope.hub.snapshot_download", {"snapshot_download": snapshot_download})):  # fmt: skip
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**attrs))
    _online(monkeypatch)
    monkeypatch.setenv("VLLM_USE_MODELSCOPE", "1")
    assert resolve_model("qwen/Tiny", "v1", download_dir=str(tmp_path / "c")) == str(tmp_path / "ms")
    assert calls["list"] == ("qwen/Tiny", "v1", True)
    model_id, revision, cache_dir, patterns = calls["download"]
    assert (model_id, revision, cache_dir) == ("qwen/Tiny", "v1", str(tmp_path / "c"))
    assert "*.safetensors" in patterns and "*.bin" not in patterns and "*.json" in patterns

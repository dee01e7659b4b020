"""Unit tests of the multimodal pieces without a model: block hashes keyed by the items a block holds, the encoder
cache's byte budget and LRU order, the runner's rows for chunks cutting through an item, and item hashes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.engine.block_pool import hash_block_tokens
from pagedllm.engine.kv_cache_manager import KVCacheManager
from pagedllm.engine.request import Request
from pagedllm.multimodal.config import MultiModalConfig
from pagedllm.multimodal.encoder_runner import EncoderCache, MultiModalRunner
from pagedllm.multimodal.hashing import hash_item
from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.sampling_params import SamplingParams

BS = 4
IMG = 9  # the placeholder token id


def request(req_id: str, tokens: list[int], features: list[MultiModalFeature]) -> Request:
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    return Request(req_id, tokens, params, None, 4, mm_features=features)


def feature(identifier: str, offset: int, length: int) -> MultiModalFeature:
    return MultiModalFeature("image", identifier, offset, length, {})


def test_block_hashes_carry_the_items_each_block_holds():
    tokens = [1, 2, 3, IMG, IMG, IMG, IMG, IMG, 5, 6, 7, 8]  # the image spans positions 3..7: blocks 0 and 1
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    req = request("a", tokens, [feature("cat", 3, 5)])
    kv.update_block_hashes(req)
    h0 = hash_block_tokens(None, tokens[0:4], ("cat",))
    h1 = hash_block_tokens(h0, tokens[4:8], ("cat",))
    h2 = hash_block_tokens(h1, tokens[8:12])
    assert req.block_hashes == [h0, h1, h2]
    other = request("b", tokens, [feature("dog", 3, 5)])
    kv.update_block_hashes(other)
    assert not set(other.block_hashes) & set(req.block_hashes)  # same tokens, other image: no block in common


def test_encoder_cache_evicts_least_recently_used_past_its_budget():
    t = torch.zeros(4, 8)  # 128 bytes
    cache = EncoderCache(capacity_bytes=300)
    cache.put("a", t)
    cache.put("b", t)
    assert cache.get("a") is t  # a is now the most recently used
    cache.put("c", t)  # over 300 bytes: b goes
    assert list(cache.entries) == ["a", "c"] and cache.num_bytes == 256
    cache.put("huge", torch.zeros(100, 8))  # alone over the budget: not kept, nothing evicted
    assert list(cache.entries) == ["a", "c"]


class FakeEncoder(torch.nn.Module):
    """Encoder output row j of an item = its pixel value + j (so each row is known)."""

    def embed_multimodal(self, modality, data):
        return data["pixel_values"][0, 0, :1] + torch.arange(5.0)[:, None]


def test_runner_rows_for_chunks_cutting_through_an_item():
    runner = MultiModalRunner(FakeEncoder(), torch.device("cpu"), torch.float32, 1 << 20)
    item = MultiModalFeature("image", "x", 2, 5, {"pixel_values": torch.full((1, 1, 1), 100.0)})
    runner.features["r"] = [item]
    # request r computes positions [0, 4) then [4, 9); a text-only request q sits before it in the flat batch
    rows, embeds = runner.step_embeddings(["q", "r"], np.array([0, 3, 7]), np.array([10, 4]))
    assert rows.tolist() == [5, 6] and embeds[:, 0].tolist() == [100.0, 101.0]  # positions 2, 3: item rows 0, 1
    rows, embeds = runner.step_embeddings(["r"], np.array([0, 5]), np.array([9]))
    assert rows.tolist() == [0, 1, 2] and embeds[:, 0].tolist() == [102.0, 103.0, 104.0]
    assert runner.num_encoder_runs == 1  # the second chunk took its rows from the cache
    assert runner.step_embeddings(["r"], np.array([0, 1]), np.array([10])) is None  # past the item: no rows


def test_item_hash_follows_pixels_and_options():
    a = np.zeros((4, 4, 3), dtype=np.uint8)
    b = a.copy()
    b[0, 0, 0] = 1
    assert hash_item("image", a, {}) == hash_item("image", a.copy(), {})
    assert hash_item("image", a, {}) != hash_item("image", b, {})
    assert hash_item("image", a, {}) != hash_item("image", a, {"do_normalize": False})


@pytest.mark.parametrize(
    "limits, match",
    [
        ({"image": -1}, r"limit_mm_per_prompt\['image'\]=-1 must be an integer >= 0"),
        ({"smell": 1}, r"modality 'smell' is not one of"),
        ([1], r"limit_mm_per_prompt=\[1\] must be a dict"),
    ],
)
def test_bad_limits(limits, match):
    with pytest.raises(ValueError, match=match):
        MultiModalConfig.from_user(limits, None, "")


def test_profile_encoder_runs_the_largest_item(tiny_llava):
    """The GPU memory profile's encoder run (here on the CPU): the tower's full-size image, its 4 tokens."""
    from mm_prompts import make_llm

    runner = make_llm(tiny_llava[2]).llm_engine.core.executor.runner
    data = runner.model.dummy_multimodal_data()
    assert data["pixel_values"].shape == (1, 3, 28, 28)
    assert runner.model.embed_multimodal("image", data).shape == (4, 64)
    runner.mm.profile_encoder()


def test_llava_with_an_unsupported_language_model_is_refused(tmp_path):
    import transformers as T
    from tiny_llava import llava_config

    from pagedllm import LLM

    config = llava_config(T.GemmaConfig)
    config.architectures = ["LlavaForConditionalGeneration"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"LLaVA with a 'gemma' language model is not supported: one of"):
        LLM(str(tmp_path), load_format="dummy", device="cpu", kv_cache_memory_bytes=1 << 22, skip_tokenizer_init=True)

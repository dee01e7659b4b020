"""Decoder models as embedders (task="embed"): last-token and mean pooling of the final hidden states against HF
transformers, on tiny random Llama / Qwen2 / Qwen3 / Mistral (sliding window) models, as task models (*ForCausalLM)
and as the bare models embedders ship (LlamaModel, MistralModel, Qwen2Model, Qwen3Model)."""

from __future__ import annotations

import json
import zlib

import pytest
import safetensors
import torch
import torch.nn.functional as F
import transformers
from tiny_models import TINY_DECODER, save_tiny_decoder

from pagedllm import LLM, PoolingParams

CASES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(TINY_DECODER)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(TINY_DECODER, num_key_value_heads=1)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(TINY_DECODER, head_dim=24)),
    "mistral-sliding": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(TINY_DECODER, sliding_window=8),
    ),
}
# token prompts of different lengths (longer than the sliding window), in one batch
PROMPTS = [[(7 * i + 3 * j) % 300 + 5 for j in range(n)] for i, n in enumerate([1, 5, 13, 30, 47, 9])]


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny_decoder(request, tmp_path_factory):
    config_cls, model_cls, kwargs = CASES[request.param]
    hf, path = save_tiny_decoder(request.param, config_cls, model_cls, kwargs, tmp_path_factory, random_norms=False)
    return path, hf


def _hf_states(hf, ids: list[int]) -> torch.Tensor:
    """[len, hidden] final (normed) hidden states of one prompt, run alone."""
    with torch.no_grad():
        return hf.model(torch.tensor([ids])).last_hidden_state[0]


def test_last_token_embedding_matches_hf(tiny_decoder):
    path, hf = tiny_decoder
    llm = LLM(path, task="embed", dtype="float32", skip_tokenizer_init=True)
    outs = llm.embed([{"prompt_token_ids": ids} for ids in PROMPTS], use_tqdm=False)
    for ids, out in zip(PROMPTS, outs):
        ref = F.normalize(_hf_states(hf, ids)[-1], dim=-1)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, atol=1e-5, rtol=1e-4)


def test_mean_pooling_matches_hf(tiny_decoder):
    path, hf = tiny_decoder
    llm = LLM(path, runner="pooling", convert="embed", dtype="float32", skip_tokenizer_init=True,
              pooler_config={"pooling_type": "MEAN", "normalize": False})  # fmt: skip
    outs = llm.embed([{"prompt_token_ids": ids} for ids in PROMPTS], use_tqdm=False)
    for ids, out in zip(PROMPTS, outs):
        ref = _hf_states(hf, ids).mean(0)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, atol=1e-5, rtol=1e-4)
    # normalize per request overrides the model default
    normed = llm.embed({"prompt_token_ids": PROMPTS[3]}, pooling_params=PoolingParams(normalize=True), use_tqdm=False)
    ref = F.normalize(_hf_states(hf, PROMPTS[3]).mean(0), dim=-1)
    torch.testing.assert_close(torch.tensor(normed[0].outputs.embedding), ref, atol=1e-5, rtol=1e-4)


def test_decoder_generates_by_default_and_refuses_embed(tiny_decoder):
    path, _ = tiny_decoder
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, num_gpu_blocks_override=16)
    with pytest.raises(ValueError, match=r"embed\(\): .* generative model .*task='embed'"):
        llm.embed({"prompt_token_ids": PROMPTS[1]}, use_tqdm=False)
    with pytest.raises(ValueError, match="task='classify'.* no classification head"):
        LLM(path, task="classify", skip_tokenizer_init=True)


# -- bare decoder checkpoints (e5-mistral's MistralModel, gte-Qwen2's Qwen2Model): no LM head, no `model.` prefix --
BARE = {
    "llama": (transformers.LlamaConfig, transformers.LlamaModel, dict(TINY_DECODER)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2Model, dict(TINY_DECODER, num_key_value_heads=1)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3Model, dict(TINY_DECODER, head_dim=24)),
    "mistral-sliding": (transformers.MistralConfig, transformers.MistralModel, dict(TINY_DECODER, sliding_window=8)),
}


@pytest.fixture(scope="module", params=sorted(BARE))
def bare_decoder(request, tmp_path_factory):
    config_cls, model_cls, kwargs = BARE[request.param]
    torch.manual_seed(zlib.crc32(request.param.encode()))
    hf = model_cls(config_cls(**kwargs)).eval()
    with torch.no_grad():  # random norms, so that the final norm matters
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
    path = tmp_path_factory.mktemp(f"bare-{request.param}")
    hf.save_pretrained(path)
    names = safetensors.safe_open(str(path / "model.safetensors"), "pt").keys()
    assert "norm.weight" in names and not any(n.startswith(("model.", "lm_head.")) for n in names)
    return str(path)


def test_bare_decoder_embeds_last_token_by_default(bare_decoder):
    """No task given: the bare model is an embedder (last token, normalized), against HF AutoModel."""
    hf = transformers.AutoModel.from_pretrained(bare_decoder).eval()
    llm = LLM(bare_decoder, dtype="float32", skip_tokenizer_init=True)
    outs = llm.embed([{"prompt_token_ids": ids} for ids in PROMPTS], use_tqdm=False)
    for ids, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = F.normalize(hf(torch.tensor([ids])).last_hidden_state[0, -1], dim=-1)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, atol=1e-5, rtol=1e-4)


def test_bare_decoder_refuses_generation(bare_decoder):
    arch = transformers.AutoConfig.from_pretrained(bare_decoder).architectures[0]
    with pytest.raises(ValueError, match=f"task/runner='generate': {arch} is a pooling model"):
        LLM(bare_decoder, task="generate", skip_tokenizer_init=True)


@pytest.mark.parametrize("model_cls", [transformers.Qwen2Model, transformers.Qwen2ForCausalLM])
def test_is_causal_false_attends_both_ways(model_cls, tmp_path):
    """hf_overrides={"is_causal": False} (vLLM's switch for gte-Qwen2-1.5B style embedders): every token attends to
    every other, as HF does with a full attention mask."""
    torch.manual_seed(5)
    hf = model_cls(transformers.Qwen2Config(**TINY_DECODER)).eval()
    hf.save_pretrained(tmp_path)
    base = hf if model_cls is transformers.Qwen2Model else hf.model
    llm = LLM(str(tmp_path), task="embed", dtype="float32", skip_tokenizer_init=True, hf_overrides={"is_causal": False})
    outs = llm.embed([{"prompt_token_ids": ids} for ids in PROMPTS], use_tqdm=False)
    for ids, out in zip(PROMPTS[1:], outs[1:]):
        full = torch.ones(1, 1, len(ids), len(ids), dtype=torch.bool)  # [batch, 1, query, key]
        with torch.no_grad():
            ref = F.normalize(base(torch.tensor([ids]), attention_mask=full).last_hidden_state[0, -1], dim=-1)
            causal = F.normalize(base(torch.tensor([ids]), attention_mask=full.tril()).last_hidden_state[0, -1], dim=-1)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, atol=1e-5, rtol=1e-4)
        assert not torch.allclose(causal, ref, atol=1e-3)  # the test tells the two apart


def _word_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer that appends </s> (the token e5-mistral / gte-Qwen2 pool), <pad> for batching."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = "the a man is eating food pasta sky blue dog cat runs fast slow house green red tree water".split()
    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "</s>", *words, ".", ","])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 2)])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="</s>"
    )


def test_e5_mistral_style_folder_matches_sentence_transformers(tmp_path):
    """MistralModel + modules.json (last-token Pooling, Normalize), as e5-mistral ships, in batches of mixed length."""
    st = pytest.importorskip("sentence_transformers")
    torch.manual_seed(11)
    config = transformers.MistralConfig(**dict(TINY_DECODER, vocab_size=32, sliding_window=8, pad_token_id=0))
    transformers.MistralModel(config).save_pretrained(tmp_path)
    _word_tokenizer().save_pretrained(tmp_path)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 64, "pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    texts = ["the man is eating food.", "a dog", "the sky is blue, the tree is green, the house is red and old."]
    ref = st.SentenceTransformer(str(tmp_path), device="cpu").encode(texts, convert_to_tensor=True).cpu()
    llm = LLM(str(tmp_path), dtype="float32")  # no task: a bare decoder embeds
    ours = torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)


def test_bare_architecture_over_task_model_weights(tmp_path):
    """config.json says LlamaModel but the weights are a LlamaForCausalLM's (`model.` prefix, lm_head): the prefix
    is dropped and the head skipped, as HF's AutoModel does."""
    torch.manual_seed(3)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_DECODER)).eval()
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaModel"]}))
    llm = LLM(str(tmp_path), dtype="float32", skip_tokenizer_init=True)
    out = llm.embed({"prompt_token_ids": PROMPTS[4]}, use_tqdm=False)[0]
    ref = F.normalize(_hf_states(hf, PROMPTS[4])[-1], dim=-1)
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, atol=1e-5, rtol=1e-4)

"""Decoder sequence classifiers (*ForSequenceClassification: the decoder plus a `score` linear over the last token)
against HF transformers on tiny random models in float32: logits and probabilities of a batch of prompts of
different lengths, the config's problem_type, score() for one label, and the errors for other uses."""

from __future__ import annotations

import json
import zlib

import pytest
import torch
import transformers as T
from tiny_models import TINY_DECODER

from pagedllm import LLM, PoolingParams

# family -> (config class, HF classifier class, config kwargs); the label count varies over the cases
CASES = {
    "llama": (T.LlamaConfig, T.LlamaForSequenceClassification, dict(TINY_DECODER, num_labels=3)),
    "mistral-sliding": (
        T.MistralConfig,
        T.MistralForSequenceClassification,
        dict(TINY_DECODER, sliding_window=8, head_dim=32, num_labels=2),
    ),
    "qwen2": (T.Qwen2Config, T.Qwen2ForSequenceClassification, dict(TINY_DECODER, num_key_value_heads=1, num_labels=1)),
    "qwen3": (T.Qwen3Config, T.Qwen3ForSequenceClassification, dict(TINY_DECODER, head_dim=24, num_labels=4)),
    "gemma": (T.GemmaConfig, T.GemmaForSequenceClassification, dict(TINY_DECODER, head_dim=32, num_labels=3)),
    "phi3": (
        T.Phi3Config,
        T.Phi3ForSequenceClassification,
        dict(TINY_DECODER, partial_rotary_factor=0.5, pad_token_id=0, num_labels=2),
    ),
    "starcoder2": (
        T.Starcoder2Config,
        T.Starcoder2ForSequenceClassification,
        dict(TINY_DECODER, use_bias=True, sliding_window=8, num_labels=3),
    ),
}
# token prompts of different lengths (longer than the sliding windows), in one batch; no pad id (0) in them
PROMPTS = [[(7 * i + 3 * j) % 300 + 5 for j in range(n)] for i, n in enumerate([1, 5, 13, 30, 47, 9])]


def _save(name: str, config_cls, model_cls, kwargs: dict, path) -> tuple[torch.nn.Module, str]:
    """A seeded random classifier with random norm weights and biases (every parameter matters), saved."""
    torch.manual_seed(zlib.crc32(name.encode()))
    hf = model_cls(config_cls(**kwargs)).eval()
    with torch.no_grad():
        for param_name, p in hf.named_parameters():
            if param_name.endswith("bias") or "norm" in param_name:
                p.normal_(0.0 if param_name.endswith("bias") else 1.0, 0.1)
    hf.save_pretrained(path)
    return hf, str(path)


def _hf_logits(hf, prompts: list[list[int]]) -> torch.Tensor:
    """[num_prompts, num_labels]: each prompt run alone (no padding), HF's logits of its last token."""
    with torch.no_grad():
        return torch.cat([hf(torch.tensor([ids])).logits for ids in prompts])


@pytest.fixture(scope="module", params=sorted(CASES))
def classifier(request, tmp_path_factory):
    config_cls, model_cls, kwargs = CASES[request.param]
    hf, path = _save(request.param, config_cls, model_cls, kwargs, tmp_path_factory.mktemp(request.param))
    return hf, LLM(path, dtype="float32", skip_tokenizer_init=True)  # task "auto": the classifier classifies


def test_logits_and_probs_match_hf(classifier):
    hf, llm = classifier
    prompts = [{"prompt_token_ids": ids} for ids in PROMPTS]
    ref = _hf_logits(hf, PROMPTS)
    raw = llm.classify(prompts, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
    assert [o.outputs.num_classes for o in raw] == [hf.config.num_labels] * len(PROMPTS)
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in raw]), ref, atol=1e-4, rtol=1e-4)
    probs = ref.sigmoid() if hf.config.num_labels == 1 else ref.softmax(-1)  # vLLM's default activation
    outs = llm.classify(prompts, use_tqdm=False)
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in outs]), probs, atol=1e-4, rtol=1e-4)
    encoded = llm.encode(prompts, use_tqdm=False)  # encode's default task is the model's own: classify
    torch.testing.assert_close(torch.stack([o.outputs.data for o in encoded]), probs, atol=1e-4, rtol=1e-4)


def test_other_uses_are_refused(classifier):
    hf, llm = classifier
    arch = hf.config.architectures[0]
    with pytest.raises(ValueError, match=rf"generate\(\): {arch} is loaded as a pooling model"):
        llm.generate({"prompt_token_ids": PROMPTS[1]})
    with pytest.raises(ValueError, match=r"embed\(\): task 'embed' is not supported"):
        llm.embed({"prompt_token_ids": PROMPTS[1]}, use_tqdm=False)
    with pytest.raises(ValueError, match=r"task 'token_classify' is not supported"):
        llm.encode({"prompt_token_ids": PROMPTS[1]}, pooling_task="token_classify", use_tqdm=False)


def test_generate_and_embed_tasks_are_refused_at_load(tmp_path):
    hf, path = _save("llama", *CASES["llama"], tmp_path)
    with pytest.raises(ValueError, match="task/runner='generate': LlamaForSequenceClassification is a pooling"):
        LLM(path, task="generate", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="task='embed': LlamaForSequenceClassification is a classification model"):
        LLM(path, task="embed", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="pooling_type='MEAN': LlamaForSequenceClassification pools with its own"):
        LLM(path, skip_tokenizer_init=True, pooler_config={"pooling_type": "MEAN"})


@pytest.mark.parametrize(
    "problem_type, num_labels, activation",
    [("regression", 1, lambda x: x), ("multi_label_classification", 3, torch.sigmoid),
     ("single_label_classification", 3, lambda x: x.softmax(-1))],
)  # fmt: skip
def test_problem_type_picks_the_activation(tmp_path, problem_type, num_labels, activation):
    """vLLM's rule, after HF's losses: regression -> the logits, multi-label -> sigmoid per label."""
    kwargs = dict(TINY_DECODER, num_labels=num_labels, problem_type=problem_type)
    hf, path = _save("llama-" + problem_type, T.LlamaConfig, T.LlamaForSequenceClassification, kwargs, tmp_path)
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True)
    outs = llm.classify([{"prompt_token_ids": ids} for ids in PROMPTS[:3]], use_tqdm=False)
    ref = activation(_hf_logits(hf, PROMPTS[:3]))
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in outs]), ref, atol=1e-4, rtol=1e-4)


def _save_word_tokenizer(path: str) -> T.PreTrainedTokenizerBase:
    """A word-level tokenizer that joins a text pair as "a b </s>" (a decoder reranker's input), saved as
    tokenizer.json in its own folder `path` (transformers would read a model folder's as its model type's class)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = "the a man is eating food pasta sky blue dog cat runs fast slow house green red tree water".split()
    vocab = {w: i for i, w in enumerate(["<pad>", "<unk>", "</s>", *words, ".", ","])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A $B </s>", special_tokens=[("</s>", 2)]
    )
    tok.save(f"{path}/tokenizer.json")
    config = {"tokenizer_class": "TokenizersBackend", "pad_token": "<pad>", "unk_token": "<unk>"}
    with open(f"{path}/tokenizer_config.json", "w") as f:
        json.dump({**config, "eos_token": "</s>"}, f)
    return T.AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("st_activation", [None, "torch.nn.modules.linear.Identity"])
def test_score_with_one_label_matches_hf(tmp_path, st_activation):
    """score(a, b) of a one-label classifier reads each pair as one input; sigmoid of its logit unless the config
    names sentence-transformers' activation (Identity: the logit), as vLLM."""
    kwargs = dict(TINY_DECODER, vocab_size=32, num_labels=1, pad_token_id=0)
    if st_activation:
        kwargs["sbert_ce_default_activation_function"] = st_activation
    hf, path = _save("qwen2-reranker", T.Qwen2Config, T.Qwen2ForSequenceClassification, kwargs, tmp_path / "model")
    (tmp_path / "tokenizer").mkdir()
    tok = _save_word_tokenizer(str(tmp_path / "tokenizer"))
    llm = LLM(path, tokenizer=str(tmp_path / "tokenizer"), task="score", dtype="float32")
    a = ["the man is eating food.", "the sky is blue.", "a red house."]
    b = ["the man is eating pasta.", "a dog runs fast, the cat runs slow.", "the green tree is near the water."]
    pairs = [tok(x, y)["input_ids"] for x, y in zip(a, b)]
    assert pairs[0] == [3, 5, 6, 7, 8, 22, 3, 5, 6, 7, 9, 22, 2]  # the words of both texts, then </s>
    ref = _hf_logits(hf, pairs)[:, 0]
    ref = ref if st_activation else ref.sigmoid()
    scores = torch.tensor([o.outputs.score for o in llm.score(a, b, use_tqdm=False)])
    torch.testing.assert_close(scores, ref, atol=1e-4, rtol=1e-4)


def test_score_with_several_labels_is_refused(classifier):
    hf, llm = classifier
    if hf.config.num_labels == 1:
        pytest.skip("one label: score() is allowed")
    with pytest.raises(ValueError, match=f"num_labels={hf.config.num_labels}; allowed: 1"):
        llm.score("a", "b", use_tqdm=False)

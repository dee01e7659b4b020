"""Token classifiers (BertForTokenClassification, RobertaForTokenClassification, XLMRobertaForTokenClassification:
NER models) against HF transformers on tiny random models in float32: the per-token logits of the token_classify
task (`encode(..., pooling_task="token_classify")`, vLLM's ner.py) for a batch of prompts of different lengths."""

from __future__ import annotations

import pytest
import torch
import transformers as T

from pagedllm import LLM, PoolingParams

ENCODER = dict(
    vocab_size=40, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
    max_position_embeddings=72, num_labels=5,
)  # fmt: skip
CASES = {
    "bert": (T.BertConfig, T.BertForTokenClassification, dict(ENCODER)),
    "roberta": (T.RobertaConfig, T.RobertaForTokenClassification, dict(ENCODER, pad_token_id=1)),
    "xlm-roberta": (T.XLMRobertaConfig, T.XLMRobertaForTokenClassification, dict(ENCODER, pad_token_id=1)),
}
# token prompts of different lengths, in one batch; ids from 3 up (no padding id, which RoBERTa's positions skip)
PROMPTS = [[(5 * i + 3 * j) % 37 + 3 for j in range(n)] for i, n in enumerate([1, 4, 17, 9, 60])]
WORDS = "the a man is eating food pasta sky blue dog cat runs fast slow house green red tree water".split()


@pytest.fixture(scope="module", params=sorted(CASES))
def token_classifier(request, tmp_path_factory):
    config_cls, model_cls, kwargs = CASES[request.param]
    torch.manual_seed(len(request.param))
    hf = model_cls(config_cls(**kwargs)).eval()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, LLM(str(path), runner="pooling", dtype="float32", skip_tokenizer_init=True)


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """[len, num_labels] logits of one prompt, run alone (no padding)."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_token_logits_match_hf(token_classifier):
    hf, llm = token_classifier
    prompts = [{"prompt_token_ids": ids} for ids in PROMPTS]
    raw = llm.encode(prompts, PoolingParams(use_activation=False), pooling_task="token_classify", use_tqdm=False)
    probs = llm.encode(prompts, pooling_task="token_classify", use_tqdm=False)
    default = llm.encode(prompts, use_tqdm=False)  # the model's own task: token_classify
    older = llm.encode(prompts, pooling_task="encode", use_tqdm=False)  # vLLM's older name of the per-token task
    reward = llm.reward(prompts, use_tqdm=False)  # vLLM's reward(): encode with "token_classify"
    for ids, r, p, d, o, w in zip(PROMPTS, raw, probs, default, older, reward):
        torch.testing.assert_close(o.outputs.data, p.outputs.data)
        torch.testing.assert_close(w.outputs.data, p.outputs.data)
        ref = _hf_logits(hf, ids)
        assert r.outputs.data.shape == (len(ids), 5) and r.prompt_token_ids == ids
        torch.testing.assert_close(r.outputs.data, ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(p.outputs.data, ref.softmax(-1), atol=1e-4, rtol=1e-4)  # vLLM's default
        torch.testing.assert_close(d.outputs.data, p.outputs.data)
        assert torch.equal(p.outputs.data.argmax(-1), ref.argmax(-1))  # ner.py's labels


def test_other_tasks_are_refused(token_classifier):
    hf, llm = token_classifier
    arch = hf.config.architectures[0]
    with pytest.raises(ValueError, match=r"classify\(\): task 'classify' is not supported by " + arch):
        llm.classify({"prompt_token_ids": PROMPTS[1]}, use_tqdm=False)
    with pytest.raises(ValueError, match=r"task 'token_embed' is not supported"):
        llm.encode({"prompt_token_ids": PROMPTS[1]}, pooling_task="token_embed", use_tqdm=False)
    with pytest.raises(ValueError, match=r"generate\(\): .* is loaded as a pooling model"):
        llm.generate({"prompt_token_ids": PROMPTS[1]})
    with pytest.raises(ValueError, match=r"normalize=True does not apply to task 'token_classify'"):
        llm.encode({"prompt_token_ids": PROMPTS[1]}, PoolingParams(normalize=True), use_tqdm=False)


def test_ner_example_flow_with_a_bert_tokenizer(tmp_path):
    """vLLM's ner.py: text in, one label per token out (id2label of the argmax), as HF's pipeline of the same
    tokens; the [CLS]/[SEP] rows are there too."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, ".", ","]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = T.BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt"))
    torch.manual_seed(3)
    labels = {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC", 4: "I-LOC"}
    config = T.BertConfig(**dict(ENCODER, vocab_size=len(vocab)), id2label=labels)
    hf = T.BertForTokenClassification(config).eval()
    hf.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), runner="pooling", dtype="float32")
    texts = ["the man is eating food.", "a dog runs fast, the cat runs slow near the green tree."]
    outs = llm.encode(texts, pooling_task="token_classify", use_tqdm=False)
    enc = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        ref = hf(**enc).logits.softmax(-1)
    for i, out in enumerate(outs):
        n = int(enc["attention_mask"][i].sum())
        assert out.prompt_token_ids == enc["input_ids"][i, :n].tolist()
        torch.testing.assert_close(out.outputs.data, ref[i, :n], atol=1e-4, rtol=1e-4)
        # ner.py's lines: the label map through vLLM's config names, the tokens' labels from the argmax
        label_map = llm.llm_engine.vllm_config.model_config.hf_config.id2label
        tokens = llm.get_tokenizer().convert_ids_to_tokens(out.prompt_token_ids)
        ours = [label_map[p.item()] for p in out.outputs.data.argmax(dim=-1)]
        assert len(tokens) == len(ours) == n
        assert ours == [labels[int(k)] for k in ref[i, :n].argmax(-1)]

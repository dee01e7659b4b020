"""Pooling models over several ranks (gloo on CPU, float32): the bundled MiniLM with TP=2 against
sentence-transformers, tiny BERT and XLM-RoBERTa cross-encoders with TP=2 against HF transformers, a decoder
embedder (a bare Qwen2Model) with TP=2 and PP=2 against HF's hidden states, pooled (last token) and per token, and a
decoder classifier (Qwen2ForSequenceClassification) with TP=2 and PP=2 against HF's logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from models import test_roberta_parity as roberta
from models.test_bert_parity import PAIRS, TEXTS, _hf_logits, _save, _tiny_config, _tokenizer
from tiny_models import TINY_DECODER

from pagedllm import LLM, PoolingParams

PROMPTS = [[(7 * i + 3 * j) % 300 + 5 for j in range(n)] for i, n in enumerate([1, 5, 13, 30, 9])]


def test_minilm_over_two_ranks_matches_sentence_transformers(minilm):
    """all-MiniLM-L6-v2's 12 heads split 6 and 6, its MLP in halves: the embeddings sentence-transformers gives."""
    st = pytest.importorskip("sentence_transformers")
    llm = LLM(minilm, task="embed", dtype="float32", tensor_parallel_size=2)
    ours = np.array([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    ref = st.SentenceTransformer(minilm, device="cpu").encode(TEXTS, convert_to_numpy=True)
    assert ours.shape == ref.shape == (len(TEXTS), 384)
    cosines = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
    assert cosines.min() >= 0.9999
    np.testing.assert_allclose(ours, ref, atol=2e-5)
    llm.llm_engine.shutdown()


def _bert(path) -> tuple[str, torch.nn.Module, list[str]]:
    """(folder, HF model, texts in its tokenizer's words)"""
    hf = transformers.BertForSequenceClassification(_tiny_config(num_labels=3)).eval()
    return _save(hf, _tokenizer(path), path), hf, [a for a, _ in PAIRS] + ["the dog."]


def _xlm_roberta(path) -> tuple[str, torch.nn.Module, list[str]]:
    hf = transformers.XLMRobertaForSequenceClassification(roberta._config(num_labels=3)).eval()
    return roberta._save(hf, path), hf, roberta.TEXTS


@pytest.mark.parametrize("make", [_bert, _xlm_roberta], ids=["bert", "xlm-roberta"])
def test_cross_encoder_over_two_ranks_matches_hf(make, tmp_path):
    """A cross-encoder: the encoder split over two ranks, the heads after it whole on each."""
    torch.manual_seed(3)
    path, hf, texts = make(tmp_path)
    llm = LLM(path, dtype="float32", tensor_parallel_size=2)
    logits = _hf_logits(hf, llm.get_tokenizer(), texts, None)
    outs = llm.classify(texts, use_tqdm=False)
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in outs]), logits.softmax(-1), atol=1e-5, rtol=1e-4)
    llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def bare_qwen2(tmp_path_factory):
    torch.manual_seed(7)
    hf = transformers.Qwen2Model(transformers.Qwen2Config(**TINY_DECODER)).eval()
    with torch.no_grad():  # random norms and biases, so that the final norm and every bias matter
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    path = tmp_path_factory.mktemp("bare-qwen2")
    hf.save_pretrained(path)
    return str(path), hf


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["TP=2", "PP=2"])
def test_decoder_embedder_over_two_ranks_matches_hf(bare_qwen2, tp, pp):
    """The last token's state (normalized: the model's default; and not) and every token's state, each against
    HF's final hidden states."""
    path, hf = bare_qwen2
    llm = LLM(
        path,
        dtype="float32",
        skip_tokenizer_init=True,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        max_num_batched_tokens=32,
    )  # fmt: skip (two batches)
    items = [{"prompt_token_ids": ids} for ids in PROMPTS]
    with torch.no_grad():
        states = [hf(torch.tensor([ids])).last_hidden_state[0] for ids in PROMPTS]  # each [len, hidden]
    last = llm.embed(items, use_tqdm=False)
    raw = llm.embed(items, pooling_params=PoolingParams(normalize=False), use_tqdm=False)
    tokens = llm.encode(items, pooling_task="token_embed", pooling_params=PoolingParams(normalize=False),
                        use_tqdm=False)  # fmt: skip
    for i, ref in enumerate(states):
        torch.testing.assert_close(torch.tensor(last[i].outputs.embedding), F.normalize(ref[-1], dim=-1),
                                   atol=1e-5, rtol=1e-4)  # fmt: skip
        torch.testing.assert_close(torch.tensor(raw[i].outputs.embedding), ref[-1], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(tokens[i].outputs.data, ref, atol=1e-5, rtol=1e-4)
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["TP=2", "PP=2"])
def test_decoder_classifier_over_two_ranks_matches_hf(tmp_path, tp, pp):
    """Qwen2ForSequenceClassification: the decoder split over two ranks (or stages), the score head on the last
    token of each prompt whole on each rank, against HF's logits of each prompt run alone."""
    torch.manual_seed(9)
    config = transformers.Qwen2Config(**TINY_DECODER, num_labels=3)
    hf = transformers.Qwen2ForSequenceClassification(config).eval()
    hf.save_pretrained(tmp_path)
    llm = LLM(
        str(tmp_path),
        dtype="float32",
        skip_tokenizer_init=True,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        max_num_batched_tokens=32,  # two batches
    )
    outs = llm.classify([{"prompt_token_ids": ids} for ids in PROMPTS], use_tqdm=False)
    with torch.no_grad():
        ref = torch.cat([hf(torch.tensor([ids])).logits for ids in PROMPTS]).softmax(-1)
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in outs]), ref, atol=1e-5, rtol=1e-4)
    llm.llm_engine.shutdown()


def test_an_encoder_refuses_pipeline_stages(tmp_path):
    """BERT-family encoders split by tensor parallelism only: two stages are refused, naming the architecture."""
    path, _, _ = _bert(tmp_path)
    with pytest.raises(ValueError, match="BertForSequenceClassification does not support pipeline parallelism"):
        LLM(path, dtype="float32", pipeline_parallel_size=2)

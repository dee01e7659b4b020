"""RoBERTa / XLM-RoBERTa encoders (bge-m3 style embedders, bge-reranker style cross-encoders) against HF transformers
and sentence-transformers, on tiny random models with a real XLM-RoBERTa (Unigram) tokenizer."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import transformers

from pagedllm import LLM, PoolingParams

WORDS = "the a man is eating food pasta sky blue dog cat runs fast slow house green red tree water".split()
PAIRS = [
    ("the man is eating food.", "the man is eating pasta."),
    ("the sky is blue.", "a dog runs fast, the cat runs slow."),
    ("a red house.", "the green tree is near the water."),
]
TEXTS = [a for a, _ in PAIRS] + [b for _, b in PAIRS] + ["dog"]
MAX_POSITIONS = 40  # with padding_idx 1 the model takes 38 tokens
ENCODERS = {
    "xlm-roberta": (transformers.XLMRobertaModel, transformers.XLMRobertaForSequenceClassification),
    "roberta": (transformers.RobertaModel, transformers.RobertaForSequenceClassification),
}


def _tokenizer() -> transformers.XLMRobertaTokenizer:
    """<s>=0 <pad>=1 </s>=2 <unk>=3; pairs as <s> a </s></s> b </s>."""
    special = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces = [("\u2581" + w, -1.0) for w in WORDS] + [(".", -2.0), (",", -2.0), ("\u2581", -3.0), ("<mask>", 0.0)]
    return transformers.XLMRobertaTokenizer(vocab=special + pieces)


def _config(num_labels: int = 2) -> transformers.XLMRobertaConfig:
    return transformers.XLMRobertaConfig(
        vocab_size=32,
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=MAX_POSITIONS,
        type_vocab_size=1,
        num_labels=num_labels,
    )


def _save(hf, path) -> str:
    hf.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", params=sorted(ENCODERS))
def tiny_encoder(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    torch.manual_seed(0)
    hf = ENCODERS[request.param][0](_config()).eval()
    return _save(hf, path), hf


def _hf_hidden(hf, tok, texts):
    enc = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        return hf(**enc).last_hidden_state, enc["attention_mask"]


def test_cls_embedding_matches_hf(tiny_encoder):
    """No sentence-transformers files: the CLS state, normalized (vLLM's default for these encoders)."""
    path, hf = tiny_encoder
    llm = LLM(path, dtype="float32")  # task "auto": an encoder embeds
    hidden, _ = _hf_hidden(hf, llm.get_tokenizer(), TEXTS)
    ours = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    torch.testing.assert_close(ours, F.normalize(hidden[:, 0], dim=-1), atol=1e-5, rtol=1e-4)


def test_token_states_match_hf_up_to_the_longest_input(tiny_encoder):
    """Every position (padding_idx + 1 + p) against HF, with an input that fills the whole position table."""
    path, hf = tiny_encoder
    llm = LLM(path, dtype="float32")
    assert llm.llm_engine.config.model.max_model_len == MAX_POSITIONS - 2
    texts = [TEXTS[1], " ".join(WORDS + WORDS[:17])]
    tok = llm.get_tokenizer()
    assert len(tok(texts[1])["input_ids"]) == MAX_POSITIONS - 2
    hidden, mask = _hf_hidden(hf, tok, texts)
    raw = PoolingParams(normalize=False)
    for i, out in enumerate(llm.encode(texts, pooling_task="token_embed", pooling_params=raw, use_tqdm=False)):
        n = int(mask[i].sum())
        torch.testing.assert_close(out.outputs.data, hidden[i, :n], atol=1e-5, rtol=1e-4)


def test_max_model_len_beyond_the_position_table_is_refused(tiny_encoder):
    path, _ = tiny_encoder
    with pytest.raises(ValueError, match=r"max_model_len=39 .*\b38\b"):
        LLM(path, max_model_len=MAX_POSITIONS - 1)


def test_bge_m3_style_folder_matches_sentence_transformers(tiny_encoder, tmp_path):
    """CLS pooling + Normalize from modules.json, as bge-m3 ships it."""
    st = pytest.importorskip("sentence_transformers")
    source, hf = tiny_encoder
    folder = tmp_path / "st"
    _save(hf, folder)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 30, "do_lower_case": False}))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 48, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False})
    )
    ref = st.SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_tensor=True).cpu()
    llm = LLM(str(folder), dtype="float32")
    assert llm.llm_engine.config.model.max_model_len == 30
    ours = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module", params=[("xlm-roberta", 1), ("xlm-roberta", 3), ("roberta", 1)])
def tiny_cross_encoder(request, tmp_path_factory):
    name, num_labels = request.param
    path = tmp_path_factory.mktemp(f"tiny-{name}-ce-{num_labels}")
    torch.manual_seed(num_labels)
    hf = ENCODERS[name][1](_config(num_labels)).eval()
    return _save(hf, path), hf


def _hf_logits(hf, tok, a, b=None):
    enc = tok(a, b, padding=True, return_tensors="pt")
    with torch.no_grad():
        return hf(**enc).logits


def test_cross_encoder_classify_matches_hf(tiny_cross_encoder):
    path, hf = tiny_cross_encoder
    llm = LLM(path, dtype="float32")  # task "auto": a *ForSequenceClassification model classifies
    logits = _hf_logits(hf, llm.get_tokenizer(), TEXTS)
    ref = torch.sigmoid(logits) if hf.config.num_labels == 1 else torch.softmax(logits, -1)
    outs = llm.classify(TEXTS, use_tqdm=False)
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in outs]), ref, atol=1e-5, rtol=1e-4)
    raw = llm.classify(TEXTS, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in raw]), logits, atol=1e-5, rtol=1e-4)


def test_reranker_score_matches_hf_and_cross_encoder(tiny_cross_encoder):
    """score(query, docs): each pair as <s> q </s></s> d </s>, sigmoid of the one label (bge-reranker)."""
    path, hf = tiny_cross_encoder
    llm = LLM(path, task="score", dtype="float32")
    a, b = [p[0] for p in PAIRS], [p[1] for p in PAIRS]
    if hf.config.num_labels != 1:
        with pytest.raises(ValueError, match="num_labels=3"):
            llm.score(a, b, use_tqdm=False)
        return
    ref = torch.sigmoid(_hf_logits(hf, llm.get_tokenizer(), a, b)[:, 0])
    ours = torch.tensor([o.outputs.score for o in llm.score(a, b, use_tqdm=False)])
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)
    st = pytest.importorskip("sentence_transformers")
    ranked = st.CrossEncoder(path, device="cpu").predict(list(zip([a[0]] * 3, b)))
    one_to_many = llm.score(a[0], b, use_tqdm=False)
    torch.testing.assert_close(
        torch.tensor([o.outputs.score for o in one_to_many]), torch.tensor(ranked).float(), atol=1e-5, rtol=1e-4
    )

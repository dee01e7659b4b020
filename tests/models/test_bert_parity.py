"""BERT encoders against their oracles: the bundled all-MiniLM-L6-v2 against sentence-transformers, tiny random
BertModel / BertForSequenceClassification against HF transformers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

from pagedllm import LLM, PoolingParams

TEXTS = [
    "Hi",
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog, and then it runs into the forest to hide from the hunters.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "Le renard brun rapide saute par-dessus le chien paresseux.",
    "El zorro marrón rápido salta sobre el perro perezoso.",
    "Быстрая коричневая лиса прыгает через ленивую собаку.",
    "敏捷的棕色狐狸跳过了懒狗。",
    "素早い茶色の狐がのろまな犬を飛び越える。",
    "صباح الخير، كيف حالك اليوم؟",
    "Emoji and symbols: 🙂 🚀 #hashtag @user 3.14159 = π",
    # long: about 250 of the 256 tokens the model takes
    " ".join(f"sentence number {i} talks about rivers, mountains and the history of science." for i in range(18)),
]


@pytest.fixture(scope="module")
def minilm_llm(minilm):
    return LLM(minilm, task="embed", dtype="float32")


@pytest.fixture(scope="module")
def st_model(minilm):
    st = pytest.importorskip("sentence_transformers")
    return st.SentenceTransformer(minilm, device="cpu")


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_minilm_matches_sentence_transformers(minilm_llm, st_model):
    lengths = [len(ids) for ids in minilm_llm.get_tokenizer()(TEXTS)["input_ids"]]
    assert max(lengths) > 200 and max(lengths) <= 256  # the long text is long but fits
    ours = np.array([o.outputs.embedding for o in minilm_llm.embed(TEXTS, use_tqdm=False)])
    ref = st_model.encode(TEXTS, convert_to_numpy=True)
    assert ours.shape == ref.shape == (len(TEXTS), 384)
    assert _cosines(ours, ref).min() >= 0.9999
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)  # the Normalize module


def test_minilm_one_at_a_time_equals_batched(minilm_llm, st_model):
    ref = st_model.encode(TEXTS[:4], convert_to_numpy=True)
    for text, r in zip(TEXTS[:4], ref):
        ours = np.array(minilm_llm.embed(text, use_tqdm=False)[0].outputs.embedding)
        assert float(ours @ r / np.linalg.norm(ours) / np.linalg.norm(r)) >= 0.9999


def test_minilm_small_batches(minilm, st_model):
    """Several forwards (2 sequences or 40 tokens each) give the same embeddings as sentence-transformers."""
    llm = LLM(minilm, task="embed", dtype="float32", max_num_seqs=2, max_num_batched_tokens=300)
    ours = np.array([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    assert _cosines(ours, st_model.encode(TEXTS, convert_to_numpy=True)).min() >= 0.9999


def test_minilm_truncation_matches_sentence_transformers(minilm_llm, st_model):
    """truncate_prompt_tokens=-1 keeps max_model_len (256) tokens with [CLS]/[SEP], as sentence-transformers does."""
    long_text = "many words about the sea and ships " * 80
    ours = minilm_llm.embed([long_text], truncate_prompt_tokens=-1, use_tqdm=False)[0]
    assert len(ours.prompt_token_ids) == 256
    ref = st_model.encode([long_text], convert_to_numpy=True)
    assert _cosines(np.array([ours.outputs.embedding]), ref)[0] >= 0.9999


# -- tiny random BERTs against HF transformers --------------------------------------------------------------------
WORDS = "the a man is eating food pasta sky blue dog cat runs fast slow house green red tree water".split()


def _tokenizer(tmp_path):
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, ".", ","]
    file = tmp_path / "vocab.txt"
    file.write_text("\n".join(vocab) + "\n")
    return transformers.BertTokenizerFast(vocab_file=str(file))


def _tiny_config(**kwargs) -> transformers.BertConfig:
    base = dict(
        vocab_size=32,
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=64,
    )
    return transformers.BertConfig(**{**base, **kwargs})


def _save(model, tok, path) -> str:
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tiny_encoder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-bert")
    torch.manual_seed(0)
    hf = transformers.BertModel(_tiny_config()).eval()
    return _save(hf, _tokenizer(path), path), hf


PAIRS = [
    ("the man is eating food.", "the man is eating pasta."),
    ("the sky is blue.", "a dog runs fast, the cat runs slow."),
    ("a red house.", "the green tree is near the water."),
]


def _hf_hidden(hf, tok, texts, pairs=None):
    enc = tok(texts, pairs, padding=True, return_tensors="pt")
    with torch.no_grad():
        return hf(**enc).last_hidden_state, enc["attention_mask"]


def test_tiny_bert_cls_pooling_matches_hf(tiny_encoder):
    """No sentence-transformers files: BERT embedders pool the [CLS] state and normalize (vLLM's default)."""
    path, hf = tiny_encoder
    llm = LLM(path, task="embed", dtype="float32")
    texts = [a for a, _ in PAIRS] + [b for _, b in PAIRS]
    hidden, _ = _hf_hidden(hf, llm.get_tokenizer(), texts)
    ref = F.normalize(hidden[:, 0], dim=-1)
    ours = torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)


def test_max_model_len_beyond_the_position_table_is_refused(tiny_encoder):
    path, _ = tiny_encoder
    with pytest.raises(ValueError, match=r"max_model_len=65 is out of range: \[1, 64\]"):
        LLM(path, task="embed", max_model_len=65)


def test_tiny_bert_mean_pooling_and_token_states_match_hf(tiny_encoder):
    path, hf = tiny_encoder
    llm = LLM(path, task="embed", dtype="float32", pooler_config={"pooling_type": "mean", "normalize": False})
    texts = [b for _, b in PAIRS]
    hidden, mask = _hf_hidden(hf, llm.get_tokenizer(), texts)
    mean = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    ours = torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    torch.testing.assert_close(ours, mean, atol=1e-5, rtol=1e-4)
    tokens = llm.encode(texts, pooling_task="token_embed", use_tqdm=False)
    for i, out in enumerate(tokens):
        n = int(mask[i].sum())
        assert out.outputs.data.shape == (n, 48)
        torch.testing.assert_close(out.outputs.data, hidden[i, :n], atol=1e-5, rtol=1e-4)
    older = llm.encode(texts, pooling_task="encode", use_tqdm=False)  # vLLM's older name of the per-token task
    assert all(torch.equal(a.outputs.data, b.outputs.data) for a, b in zip(older, tokens))


@pytest.fixture(scope="module", params=[1, 3])
def tiny_cross_encoder(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny-ce-{request.param}")
    torch.manual_seed(request.param)
    hf = transformers.BertForSequenceClassification(_tiny_config(num_labels=request.param)).eval()
    return _save(hf, _tokenizer(path), path), hf


def _hf_logits(hf, tok, a, b):
    enc = tok(a, b, padding=True, return_tensors="pt")
    with torch.no_grad():
        return hf(**enc).logits


def test_cross_encoder_classify_matches_hf(tiny_cross_encoder):
    path, hf = tiny_cross_encoder
    llm = LLM(path, dtype="float32")  # task "auto": a *ForSequenceClassification model classifies
    texts = [a for a, _ in PAIRS] + ["the dog."]
    logits = _hf_logits(hf, llm.get_tokenizer(), texts, None)
    ref = torch.sigmoid(logits) if hf.config.num_labels == 1 else torch.softmax(logits, -1)
    outs = llm.classify(texts, use_tqdm=False)
    assert [o.outputs.num_classes for o in outs] == [hf.config.num_labels] * len(texts)
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in outs]), ref, atol=1e-5, rtol=1e-4)
    raw = llm.classify(texts, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
    torch.testing.assert_close(torch.tensor([o.outputs.probs for o in raw]), logits, atol=1e-5, rtol=1e-4)


def test_cross_encoder_score_matches_hf(tiny_cross_encoder):
    """score(a, b) runs the pair as one input ([CLS] a [SEP] b [SEP], segment ids 0/1); sigmoid of the one label."""
    path, hf = tiny_cross_encoder
    llm = LLM(path, task="score", dtype="float32")
    a, b = [p[0] for p in PAIRS], [p[1] for p in PAIRS]
    if hf.config.num_labels != 1:
        with pytest.raises(ValueError, match="num_labels=3"):
            llm.score(a, b, use_tqdm=False)
        return
    ref = torch.sigmoid(_hf_logits(hf, llm.get_tokenizer(), a, b)[:, 0])
    pairwise = llm.score(a, b, use_tqdm=False)
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in pairwise]), ref, atol=1e-5, rtol=1e-4)
    one_to_many = llm.score(a[0], b, use_tqdm=False)
    ref_1n = torch.sigmoid(_hf_logits(hf, llm.get_tokenizer(), [a[0]] * 3, b)[:, 0])
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in one_to_many]), ref_1n, atol=1e-5, rtol=1e-4)


# -- sentence-transformers folders: pooling mode and Normalize read from modules.json ------------------------------
ST_MODES = {"MEAN": "pooling_mode_mean_tokens", "CLS": "pooling_mode_cls_token", "LAST": "pooling_mode_lasttoken"}
ST_MODES["MAX"] = "pooling_mode_max_tokens"


@pytest.mark.parametrize("mode, normalize", [("MEAN", False), ("CLS", True), ("LAST", False), ("MAX", True)])
def test_sentence_transformers_folder_matches_sentence_transformers(tiny_encoder, tmp_path, mode, normalize):
    st = pytest.importorskip("sentence_transformers")
    source, _ = tiny_encoder
    folder = tmp_path / "st"
    transformers.BertModel.from_pretrained(source).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 40, "do_lower_case": False}))
    (folder / "1_Pooling").mkdir()
    pooling = {key: key == ST_MODES[mode] for key in ST_MODES.values()}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 48, **pooling}))
    texts = [a for a, _ in PAIRS] + [b for _, b in PAIRS]
    ref = st.SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_tensor=True)
    llm = LLM(str(folder), dtype="float32")
    assert llm.llm_engine.config.model.max_model_len == 40
    ours = torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    torch.testing.assert_close(ours, ref.cpu(), atol=1e-5, rtol=1e-4)


def test_unsupported_sentence_transformers_modules_are_refused(tiny_encoder, tmp_path):
    source, _ = tiny_encoder
    folder = tmp_path / "dense"
    transformers.BertModel.from_pretrained(source).save_pretrained(folder)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "sentence_transformers.models.Dense"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match=r"sentence-transformers modules \['Dense'\] are not supported"):
        LLM(str(folder), skip_tokenizer_init=True)

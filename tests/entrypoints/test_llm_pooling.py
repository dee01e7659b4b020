"""The pooling API on the bundled all-MiniLM-L6-v2: embed / encode / score against sentence-transformers and HF
transformers, PoolingParams fields, and the errors a user can run into (the engine keeps serving after each)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

from pagedllm import (
    LLM,
    EmbeddingRequestOutput,
    PoolingParams,
    PoolingRequestOutput,
    ScoringRequestOutput,
    TokensPrompt,
)

QUERY = "How do I bake bread at home?"
DOCS = [
    "Mix flour, water, salt and yeast, let the dough rise, then bake it in a hot oven.",
    "The stock market fell sharply on Tuesday.",
    "Pour faire du pain, mélangez la farine, l'eau et la levure.",
]


@pytest.fixture(scope="module")
def llm(minilm):
    return LLM(task="embed", dtype="float32")  # no model: the bundled all-MiniLM-L6-v2


@pytest.fixture(scope="module")
def st_model(minilm):
    st = pytest.importorskip("sentence_transformers")
    return st.SentenceTransformer(minilm, device="cpu")


@pytest.fixture(scope="module")
def hf_mean(minilm):
    """Mean of HF BertModel's token states over the attention mask, not normalized (the oracle for normalize=False)."""
    tok = transformers.AutoTokenizer.from_pretrained(minilm)
    model = transformers.AutoModel.from_pretrained(minilm).eval()

    def run(texts: list[str]) -> torch.Tensor:
        enc = tok(texts, padding=True, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**enc).last_hidden_state
        mask = enc["attention_mask"][..., None]
        return (hidden * mask).sum(1) / mask.sum(1), hidden, enc["attention_mask"]

    return run


def _cos(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_default_embedding_model_and_output_types(llm, st_model):
    assert llm.llm_engine.config.model.architecture == "BertModel"
    assert llm.llm_engine.config.model.max_model_len == 256  # sentence_bert_config.json's max_seq_length
    outs = llm.embed(DOCS, use_tqdm=False)
    assert all(isinstance(o, EmbeddingRequestOutput) for o in outs)
    assert [o.outputs.hidden_size for o in outs] == [384] * 3
    ref = st_model.encode(DOCS, convert_to_numpy=True)
    assert min(_cos(o.outputs.embedding, r) for o, r in zip(outs, ref)) >= 0.9999
    ids = llm.get_tokenizer()(DOCS[0])["input_ids"]
    assert outs[0].prompt_token_ids == ids
    by_ids = llm.embed([TokensPrompt(prompt_token_ids=ids), ids], use_tqdm=False)
    assert _cos(by_ids[0].outputs.embedding, ref[0]) >= 0.9999 and by_ids[1].outputs.embedding == pytest.approx(
        by_ids[0].outputs.embedding, abs=1e-6
    )


def test_score_is_cosine_of_embeddings(llm, st_model):
    ref = st_model.encode([QUERY, *DOCS], convert_to_numpy=True)
    one_to_many = llm.score(QUERY, DOCS, use_tqdm=False)
    assert all(isinstance(o, ScoringRequestOutput) for o in one_to_many)
    expected = [_cos(ref[0], r) for r in ref[1:]]
    assert [o.outputs.score for o in one_to_many] == pytest.approx(expected, abs=1e-4)
    ours = [o.outputs.embedding for o in llm.embed([QUERY, *DOCS], use_tqdm=False)]
    assert [o.outputs.score for o in one_to_many] == pytest.approx([_cos(ours[0], e) for e in ours[1:]], abs=1e-6)
    pairwise = llm.score([QUERY, DOCS[0], DOCS[1]], DOCS, use_tqdm=False)  # N to N, pair by pair
    expected = [_cos(ref[0], ref[1]), _cos(ref[1], ref[2]), _cos(ref[2], ref[3])]
    assert [o.outputs.score for o in pairwise] == pytest.approx(expected, abs=1e-4)
    single = llm.score(text_1=QUERY, text_2=DOCS[1], use_tqdm=False)  # vLLM's older keyword names, 1 to 1
    assert len(single) == 1 and single[0].outputs.score == pytest.approx(_cos(ref[0], ref[2]), abs=1e-4)


def test_encode_returns_pooled_tensors(llm, hf_mean):
    embedded = llm.embed(DOCS, use_tqdm=False)
    encoded = llm.encode(DOCS, use_tqdm=False)  # the model's own task: embed
    assert all(isinstance(o, PoolingRequestOutput) for o in encoded)
    for e, p in zip(embedded, encoded):
        assert p.outputs.data.shape == (384,)
        assert p.outputs.data.tolist() == pytest.approx(e.outputs.embedding, abs=1e-6)
    _, hidden, mask = hf_mean(DOCS[:2])
    tokens = llm.encode(DOCS[:2], pooling_task="token_embed", use_tqdm=False)
    for i, out in enumerate(tokens):
        n = int(mask[i].sum())
        torch.testing.assert_close(out.outputs.data, F.normalize(hidden[i, :n], dim=-1), atol=1e-5, rtol=1e-4)


def test_encode_of_an_embedding_model_reads_as_vllms_example(llm, st_model):
    """`llm.encode(texts)[0].outputs.embedding` (vLLM's example for an embedding model) next to `.data`."""
    out = llm.encode(DOCS[:2], use_tqdm=False)
    for i, o in enumerate(out):
        assert isinstance(o.outputs.embedding, list) and len(o.outputs.embedding) == 384
        assert o.outputs.embedding == o.outputs.data.tolist()
        assert _cos(o.outputs.embedding, st_model.encode([DOCS[i]])[0]) >= 0.9999
    tokens = llm.encode(DOCS[:1], pooling_task="token_embed", use_tqdm=False)[0].outputs
    assert not hasattr(tokens, "embedding")  # one vector per token: the tensor alone


def test_normalize_false_gives_the_plain_mean(llm, hf_mean):
    outs = llm.embed(DOCS, pooling_params=PoolingParams(normalize=False), use_tqdm=False)
    mean, _, _ = hf_mean(DOCS)
    torch.testing.assert_close(torch.tensor([o.outputs.embedding for o in outs]), mean, atol=1e-5, rtol=1e-4)


def test_matryoshka_dimensions(minilm, st_model):
    """dimensions keeps the first features, then normalizes (vLLM); allowed only for Matryoshka models."""
    llm = LLM(minilm, task="embed", dtype="float32", hf_overrides={"is_matryoshka": True})
    outs = llm.embed(DOCS, pooling_params=PoolingParams(dimensions=128), use_tqdm=False)
    full = st_model.encode(DOCS, convert_to_numpy=True)
    ref = full[:, :128] / np.linalg.norm(full[:, :128], axis=1, keepdims=True)
    assert [o.outputs.hidden_size for o in outs] == [128] * 3
    np.testing.assert_allclose(np.array([o.outputs.embedding for o in outs]), ref, atol=1e-5)
    with pytest.raises(ValueError, match=r"dimensions=400 is out of range: \[1, 384\]"):
        llm.embed(DOCS[0], pooling_params=PoolingParams(dimensions=400), use_tqdm=False)
    sized = LLM(minilm, task="embed", dtype="float32", hf_overrides={"matryoshka_dimensions": [64, 128]})
    with pytest.raises(ValueError, match=r"dimensions=100 .*\[64, 128\]"):
        sized.embed(DOCS[0], pooling_params=PoolingParams(dimensions=100), use_tqdm=False)
    small = sized.embed(DOCS[0], pooling_params=PoolingParams(dimensions=64), use_tqdm=False)[0]
    np.testing.assert_allclose(small.outputs.embedding, full[0, :64] / np.linalg.norm(full[0, :64]), atol=1e-5)


# -- errors ----------------------------------------------------------------------------------------------------
def test_too_long_text_is_an_error_unless_truncation_is_asked(llm, st_model):
    long_text = "word " * 400
    with pytest.raises(ValueError, match=r"prompt length 402 is longer than max_model_len=256"):
        llm.embed(["short", long_text], use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt length 402 .*max_model_len=256"):
        llm.score(QUERY, long_text, use_tqdm=False)
    cut = llm.embed(long_text, truncate_prompt_tokens=100, use_tqdm=False)[0]
    assert len(cut.prompt_token_ids) == 100
    ids = llm.get_tokenizer()(long_text, truncation=True, max_length=100)["input_ids"]
    assert cut.prompt_token_ids == ids  # [CLS] + the first 98 tokens + [SEP]
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens=300 is out of range: -1 or \[1, 256\]"):
        llm.embed(long_text, truncate_prompt_tokens=300, use_tqdm=False)
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens=0 is out of range"):
        llm.score(QUERY, long_text, truncate_prompt_tokens=0, use_tqdm=False)
    scored = llm.score(QUERY, [long_text, DOCS[0]], truncate_prompt_tokens=-1, use_tqdm=False)
    ref = st_model.encode([QUERY, long_text, DOCS[0]], convert_to_numpy=True)  # truncates at 256 tokens
    assert [o.outputs.score for o in scored] == pytest.approx([_cos(ref[0], ref[1]), _cos(ref[0], ref[2])], abs=1e-4)
    # the engine serves the next call
    assert _cos(llm.embed(DOCS[0], use_tqdm=False)[0].outputs.embedding, st_model.encode([DOCS[0]])[0]) >= 0.9999


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dimensions=0), r"dimensions=0 is out of range: None or an integer >= 1"),
        (dict(dimensions=1.5), r"dimensions=1.5 is out of range"),
        (dict(truncate_prompt_tokens=0), r"truncate_prompt_tokens=0 is out of range: None, -1"),
        (dict(normalize="yes"), r"normalize='yes' is out of range: None, True or False"),
        (dict(task="generate"), r"task='generate' is out of range"),
        (dict(activation=True, use_activation=False), r"activation=True and use_activation=False disagree"),
    ],
)
def test_bad_pooling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PoolingParams(**kwargs)


def test_pooling_params_that_do_not_fit_the_model_or_task(llm, st_model):
    with pytest.raises(ValueError, match=r"dimensions=128: this model does not support Matryoshka"):
        llm.embed(DOCS[0], pooling_params=PoolingParams(dimensions=128), use_tqdm=False)
    with pytest.raises(ValueError, match=r"use_activation=True does not apply to task 'embed'"):
        llm.embed(DOCS[0], pooling_params=PoolingParams(use_activation=True), use_tqdm=False)
    with pytest.raises(ValueError, match=r"normalize=False does not apply to task 'score'"):
        llm.score(QUERY, DOCS, pooling_params=PoolingParams(normalize=False), use_tqdm=False)
    with pytest.raises(ValueError, match=r"pooling_params has 2 entries but there are 3 prompts"):
        llm.embed(DOCS, pooling_params=[PoolingParams()] * 2, use_tqdm=False)
    assert _cos(llm.embed(DOCS[1], use_tqdm=False)[0].outputs.embedding, st_model.encode([DOCS[1]])[0]) >= 0.9999


def test_wrong_task_for_the_model(llm, smollm2):
    with pytest.raises(ValueError, match=r"classify\(\): task 'classify' is not supported by BertModel"):
        llm.classify(DOCS, use_tqdm=False)
    with pytest.raises(ValueError, match=r"generate\(\): BertModel is loaded as a pooling model"):
        llm.generate("Hello")
    with pytest.raises(ValueError, match=r"data_1 has 2 items and data_2 has 3"):
        llm.score(DOCS[:2], DOCS, use_tqdm=False)
    with pytest.raises(ValueError, match=r"task 'score' of an embedding model .* use score\(\)"):
        llm.encode(DOCS, pooling_task="score", use_tqdm=False)
    with pytest.raises(ValueError, match=r"lora_request: LoRA is off; create the engine with enable_lora=True"):
        llm.score(QUERY, DOCS, lora_request=object(), use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompts is empty"):
        llm.embed([], use_tqdm=False)
    with pytest.raises(ValueError, match=r"task/runner='generate': BertModel is a pooling model"):
        LLM(llm.llm_engine.config.model.model_path, task="generate")
    with pytest.raises(ValueError, match=r"task='classify': BertModel is an embedding model"):
        LLM(llm.llm_engine.config.model.model_path, task="classify")
    with pytest.raises(ValueError, match=r"task='bogus' must be one of"):
        LLM(task="bogus")
    generator = LLM(smollm2, dtype="float32", num_gpu_blocks_override=32)  # the bundled generative model
    with pytest.raises(ValueError, match=r"embed\(\): LlamaForCausalLM is loaded as a generative model"):
        generator.embed("Hello", use_tqdm=False)
    assert len(llm.embed("still serving", use_tqdm=False)[0].outputs.embedding) == 384


def test_runner_and_convert_names(minilm, st_model):
    llm = LLM(minilm, runner="pooling", convert="embed", dtype="float32")
    ref = st_model.encode([QUERY], convert_to_numpy=True)[0]
    assert _cos(llm.embed(QUERY, use_tqdm=False)[0].outputs.embedding, ref) >= 0.9999

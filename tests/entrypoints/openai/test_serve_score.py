"""vLLM's pooling endpoints on `pagedllm serve`: /v1/score, /v1/rerank (/rerank, /v2/rerank) and /pooling on a tiny
cross-encoder, equal to the offline `LLM.score` / `LLM.classify`, in vLLM's response layout; bad bodies are 400;
/v1/score and /pooling on the embedding server equal the offline cosine and embeddings; the endpoints refuse a
generative server."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
import transformers
from conftest import RemoteServer

QUERY = "the man is eating food."
DOCS = ["the man is eating pasta.", "a dog runs fast.", "the sky is blue.", "a red house near the water."]
WORDS = "the a man is eating food pasta sky blue dog cat runs fast slow house green red tree water near".split()
NAME = "tiny-reranker"


def _save_cross_encoder(path) -> str:
    special = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces = [("\u2581" + w, -1.0) for w in WORDS] + [(".", -2.0), (",", -2.0), ("\u2581", -3.0), ("<mask>", 0.0)]
    config = transformers.XLMRobertaConfig(
        vocab_size=32, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
        max_position_embeddings=40, type_vocab_size=1, num_labels=1,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.XLMRobertaForSequenceClassification(config).eval().save_pretrained(path)
    transformers.XLMRobertaTokenizer(vocab=special + pieces).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    path = _save_cross_encoder(tmp_path_factory.mktemp("tiny-reranker"))
    server = RemoteServer([path, "--served-model-name", NAME, "--task", "score", "--dtype", "float32"], model=NAME)
    from pagedllm import LLM

    llm = LLM(path, task="score", dtype="float32")
    try:
        server.wait_ready()
        yield server, llm
    finally:
        server.stop()


def test_score_equals_offline(reranker):
    server, llm = reranker
    expected = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    for path, body in (
        ("/v1/score", {"model": NAME, "text_1": QUERY, "text_2": DOCS}),
        ("/score", {"data_1": [QUERY] * len(DOCS), "data_2": DOCS}),
        ("/v1/score", {"queries": QUERY, "documents": DOCS}),
    ):
        status, resp = server.request("POST", path, body)
        assert status == 200, resp
        assert resp["object"] == "list" and resp["model"] == NAME and resp["id"].startswith("score-")
        assert [d["index"] for d in resp["data"]] == list(range(len(DOCS)))
        assert all(d["object"] == "score" for d in resp["data"])
        np.testing.assert_allclose([d["score"] for d in resp["data"]], expected, atol=1e-5)
        assert resp["usage"]["prompt_tokens"] == resp["usage"]["total_tokens"] > 0


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_orders_by_score(reranker, path):
    server, llm = reranker
    expected = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    order = sorted(range(len(DOCS)), key=lambda i: -expected[i])
    status, resp = server.request("POST", path, {"model": NAME, "query": QUERY, "documents": DOCS, "top_n": 2})
    assert status == 200, resp
    assert resp["id"].startswith("rerank-") and resp["model"] == NAME and resp["usage"]["total_tokens"] > 0
    assert [r["index"] for r in resp["results"]] == order[:2]
    assert [r["document"]["text"] for r in resp["results"]] == [DOCS[i] for i in order[:2]]
    np.testing.assert_allclose([r["relevance_score"] for r in resp["results"]], sorted(expected)[::-1][:2], atol=1e-5)
    status, resp = server.request("POST", path, {"query": QUERY, "documents": DOCS, "return_documents": False})
    assert status == 200 and len(resp["results"]) == len(DOCS) and "document" not in resp["results"][0]


def test_pooling_equals_offline_classify(reranker):
    server, llm = reranker
    expected = [o.outputs.probs for o in llm.classify(DOCS, use_tqdm=False)]
    status, resp = server.request("POST", "/pooling", {"model": NAME, "input": DOCS})
    assert status == 200, resp
    assert resp["id"].startswith("pool-") and resp["object"] == "list"
    assert all(d["object"] == "pooling" for d in resp["data"])
    np.testing.assert_allclose([d["data"] for d in resp["data"]], expected, atol=1e-5)
    status, resp = server.request("POST", "/pooling", {"input": DOCS[0], "encoding_format": "base64"})
    decoded = np.frombuffer(base64.b64decode(resp["data"][0]["data"]), dtype="<f4")
    np.testing.assert_allclose(decoded, expected[0], atol=1e-5)


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/score", {"text_2": DOCS}, "text_1"),
        ("/v1/score", {"text_1": QUERY, "data_1": QUERY, "text_2": DOCS}, "text_1"),
        ("/v1/score", {"text_1": [QUERY, QUERY], "text_2": DOCS}, "text_1"),
        ("/v1/score", {"text_1": QUERY, "text_2": []}, "text_2"),
        ("/v1/score", {"text_1": QUERY, "text_2": DOCS, "softmax": True}, "softmax"),
        ("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n"),
        ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
        ("/v1/rerank", {"query": "", "documents": DOCS}, "query"),
        ("/v1/rerank", {"query": QUERY, "documents": DOCS, "truncate_prompt_tokens": -5}, "truncate_prompt_tokens"),
        ("/pooling", {"input": []}, "input"),
        ("/pooling", {"input": "x", "task": "embed"}, None),
        ("/pooling", {"input": "x", "dimensions": 4}, "dimensions"),
    ],
)
def test_bad_bodies_are_400(reranker, path, body, param):
    server, _ = reranker
    status, resp = server.request("POST", path, body)
    assert status == 400, resp
    if param is not None:
        assert resp["error"]["param"] == param, resp
    assert server.request("POST", "/v1/score", {"text_1": QUERY, "text_2": DOCS[0]})[0] == 200


def test_generation_endpoints_refused(reranker):
    server, _ = reranker
    status, resp = server.request("POST", "/generate", {"prompt": "hi"})
    assert status == 400 and "pooling model" in resp["error"]["message"]


def test_embedding_server_scores_by_cosine(embed_server, minilm):
    from pagedllm import LLM

    llm = LLM(minilm, task="embed")
    vectors = np.array([o.outputs.embedding for o in llm.embed([QUERY, *DOCS], use_tqdm=False)])
    cosine = vectors[1:] @ vectors[0] / (np.linalg.norm(vectors[1:], axis=1) * np.linalg.norm(vectors[0]))
    status, resp = embed_server.request("POST", "/v1/score", {"text_1": QUERY, "text_2": DOCS})
    assert status == 200, resp
    np.testing.assert_allclose([d["score"] for d in resp["data"]], cosine, atol=1e-5)
    status, resp = embed_server.request("POST", "/pooling", {"input": DOCS[:2]})
    assert status == 200, resp
    np.testing.assert_allclose([d["data"] for d in resp["data"]], vectors[1:3], atol=1e-5)


def test_generative_server_refuses_pooling_endpoints(server):
    for path, body in (("/v1/score", {"text_1": "a", "text_2": "b"}), ("/pooling", {"input": "a"})):
        status, resp = server.request("POST", path, body)
        assert status == 400 and "generative model" in resp["error"]["message"], resp

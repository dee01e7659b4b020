"""`pagedllm serve --task embed`: /v1/embeddings through the openai client equal to the offline `LLM.embed`, as
floats and as base64; token-id inputs; bad inputs are 400 and text generation is refused on a pooling server."""

from __future__ import annotations

import base64

import numpy as np
import pytest

MODEL_NAME = "minilm-test"  # conftest's embed_server --served-model-name
TEXTS = ["The cat sat on the mat.", "A quick brown fox.", "Embeddings map text to vectors."]


@pytest.fixture(scope="module")
def offline_embeddings(minilm, embed_server):
    from pagedllm import LLM

    llm = LLM(minilm, task="embed")
    outputs = llm.embed(TEXTS, use_tqdm=False)
    return np.array([o.outputs.embedding for o in outputs]), [o.prompt_token_ids for o in outputs]


def test_embeddings_equal_offline(embed_server, offline_embeddings):
    expected, token_ids = offline_embeddings
    client = embed_server.client()
    resp = client.embeddings.create(model=MODEL_NAME, input=TEXTS)  # the client asks for base64 and decodes it
    got = np.array([d.embedding for d in resp.data])
    assert [d.index for d in resp.data] == [0, 1, 2] and resp.model == MODEL_NAME
    np.testing.assert_allclose(got, expected, atol=1e-5)
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(len(t) for t in token_ids)
    as_floats = client.embeddings.create(model=MODEL_NAME, input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(as_floats.data[0].embedding, expected[0], atol=1e-5)
    from_ids = client.embeddings.create(model=MODEL_NAME, input=token_ids[1], encoding_format="float")
    np.testing.assert_allclose(from_ids.data[0].embedding, expected[1], atol=1e-5)


def test_base64_layout(embed_server, offline_embeddings):
    status, body = embed_server.request("POST", "/v1/embeddings", {"input": TEXTS[2], "encoding_format": "base64"})
    assert status == 200 and body["object"] == "list" and body["data"][0]["object"] == "embedding"
    vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vector, offline_embeddings[0][2], atol=1e-5)


def test_bad_embedding_requests(embed_server):
    for body, param in (
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": [10**9]}, "input"),
        ({"input": "x", "dimensions": 8}, "dimensions"),  # all-MiniLM-L6-v2 is not a Matryoshka model
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": ["x"] * 300}, "input"),
        ({"input": "x", "model": "other"}, "model"),
    ):
        status, err = embed_server.request("POST", "/v1/embeddings", body)
        assert status == (404 if param == "model" else 400), (body, err)
        assert err["error"]["param"] == param, err
    status, err = embed_server.request("POST", "/v1/completions", {"prompt": "hello"})
    assert status == 400 and "pooling model" in err["error"]["message"]
    status, _ = embed_server.request("POST", "/v1/embeddings", {"input": "still serving"})
    assert status == 200


def test_sigterm_drains_in_flight_requests(embed_server):
    """Last in this module: SIGTERM lets the running request finish (200), then the server exits by itself."""
    import signal
    import threading
    import time

    texts = [f"sentence number {i} " * 40 for i in range(100)]
    result = {}

    def post() -> None:
        result["status"], result["body"] = embed_server.request("POST", "/v1/embeddings", {"input": texts})

    worker = threading.Thread(target=post)
    worker.start()
    time.sleep(0.5)  # the request is in flight
    embed_server.proc.send_signal(signal.SIGTERM)
    worker.join(60)
    assert result.get("status") == 200 and len(result["body"]["data"]) == len(texts)
    assert embed_server.proc.wait(30) == 0  # a clean drain is a normal exit, not a re-raised SIGTERM
    assert "Traceback" not in embed_server.read_log()

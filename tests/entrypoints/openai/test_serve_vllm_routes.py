"""vLLM's routes and inputs beyond OpenAI's: `messages` on /v1/embeddings and /pooling (rendered with the chat
template, then pooled), POST /classify on a tiny BertForSequenceClassification (equal to the offline
`LLM.classify`), GET/POST /ping, and POST /invocations (SageMaker's one route, dispatched by the body's shape)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from conftest import MODEL_NAME, RemoteServer

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
TEMPLATE += "{% if add_generation_prompt %}bot:{% endif %}"
MESSAGES = [{"role": "user", "content": "The cat sat on the mat."}, {"role": "assistant", "content": "A fine cat."}]
RENDERED = "user: The cat sat on the mat.\nassistant: A fine cat.\n"
WORDS = "the a man is eating food pasta sky blue dog cat runs fast slow house green red tree water".split()
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
TEXTS = ["the man is eating food.", "the sky is blue.", "a dog runs fast."]


@pytest.fixture(scope="module")
def chat_embed_server(minilm, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "embed.jinja"
    template.write_text(TEMPLATE)
    server = RemoteServer([minilm, "--task", "embed", "--chat-template", str(template)], model=None)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-bert-classifier")
    vocab = path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, ".", ","]) + "\n")
    config = transformers.BertConfig(
        vocab_size=32, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
        max_position_embeddings=64, num_labels=3, id2label=LABELS, label2id={v: k for k, v in LABELS.items()},
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.BertForSequenceClassification(config).eval().save_pretrained(path)
    transformers.BertTokenizerFast(vocab_file=str(vocab)).save_pretrained(path)
    server = RemoteServer([str(path), "--served-model-name", "tiny-classifier", "--dtype", "float32"])
    from pagedllm import LLM

    llm = LLM(str(path), dtype="float32")
    try:
        server.wait_ready()
        yield server, llm
    finally:
        server.stop()


def _vectors(server, path: str, body: dict) -> np.ndarray:
    status, resp = server.request("POST", path, body)
    assert status == 200, resp
    return np.array([d["embedding"] if d["object"] == "embedding" else d["data"] for d in resp["data"]])


@pytest.mark.parametrize("path", ["/v1/embeddings", "/pooling"])
def test_messages_are_rendered_then_pooled(chat_embed_server, minilm, path):
    server = chat_embed_server
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm)
    plain = tokenizer.encode(RENDERED, add_special_tokens=False)  # the template writes the special tokens (none)
    expected = _vectors(server, path, {"input": plain})
    np.testing.assert_allclose(_vectors(server, path, {"messages": MESSAGES}), expected, atol=1e-5)
    with_special = _vectors(server, path, {"messages": MESSAGES, "add_special_tokens": True})
    np.testing.assert_allclose(with_special, _vectors(server, path, {"input": RENDERED}), atol=1e-5)
    prompted = _vectors(server, path, {"messages": MESSAGES, "add_generation_prompt": True, "add_special_tokens": True})
    np.testing.assert_allclose(prompted, _vectors(server, path, {"input": RENDERED + "bot:"}), atol=1e-5)
    continued = {"messages": MESSAGES, "continue_final_message": True, "add_special_tokens": True}
    np.testing.assert_allclose(
        _vectors(server, path, continued), _vectors(server, path, {"input": RENDERED.rstrip("\n")}), atol=1e-5
    )


@pytest.mark.parametrize(
    "body,param",
    [
        ({"input": "x", "messages": MESSAGES}, "messages"),
        ({}, "input"),
        ({"encoding_format": "float"}, "input"),
        ({"input": "x", "add_generation_prompt": True}, "add_generation_prompt"),
        ({"input": "x", "chat_template_kwargs": {"a": 1}}, "chat_template_kwargs"),
        ({"input": "x", "add_special_tokens": False}, "add_special_tokens"),
        ({"messages": MESSAGES, "chat_template": "{{ messages }}"}, "chat_template"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ],
)
def test_bad_pooling_inputs_are_400(chat_embed_server, body, param):
    for path in ("/v1/embeddings", "/pooling"):
        status, resp = chat_embed_server.request("POST", path, body)
        assert status == 400 and resp["error"]["param"] == param, (path, resp)


def test_classify_equals_offline(classifier):
    server, llm = classifier
    expected = np.array([o.outputs.probs for o in llm.classify(TEXTS, use_tqdm=False)])
    status, resp = server.request("POST", "/classify", {"model": "tiny-classifier", "input": TEXTS})
    assert status == 200, resp
    assert resp["id"].startswith("classify-") and resp["object"] == "list" and resp["model"] == "tiny-classifier"
    assert [d["index"] for d in resp["data"]] == [0, 1, 2] and all(d["num_classes"] == 3 for d in resp["data"])
    np.testing.assert_allclose([d["probs"] for d in resp["data"]], expected, atol=1e-5)
    assert [d["label"] for d in resp["data"]] == [LABELS[int(i)] for i in expected.argmax(1)]
    assert resp["usage"]["prompt_tokens"] == resp["usage"]["total_tokens"] > 0
    status, one = server.request("POST", "/classify", {"input": TEXTS[1]})
    assert status == 200 and len(one["data"]) == 1
    np.testing.assert_allclose(one["data"][0]["probs"], expected[1], atol=1e-5)
    status, via = server.request("POST", "/invocations", {"input": TEXTS})  # a classifier's input: /classify
    assert status == 200 and via["id"].startswith("classify-"), via
    np.testing.assert_allclose([d["probs"] for d in via["data"]], expected, atol=1e-5)
    for body, param in (({"input": []}, "input"), ({"input": "x", "model": "other"}, "model"), ({}, "input")):
        status, err = server.request("POST", "/classify", body)
        assert status == (404 if param == "model" else 400) and err["error"]["param"] == param, err


def test_classify_refused_elsewhere(chat_embed_server, server):
    status, resp = chat_embed_server.request("POST", "/classify", {"input": "x"})
    assert status == 400 and "sequence-classification" in resp["error"]["message"], resp
    status, resp = server.request("POST", "/classify", {"input": "x"})
    assert status == 400 and "generative model" in resp["error"]["message"], resp


def test_ping_and_invocations_on_a_pooling_server(chat_embed_server):
    server = chat_embed_server
    assert server.request("GET", "/ping")[0] == 200 and server.request("POST", "/ping")[0] == 200
    for body in ({"input": ["a cat.", "a dog."]}, {"messages": MESSAGES}):
        status, resp = server.request("POST", "/invocations", body)
        assert status == 200 and resp["data"][0]["object"] == "embedding", resp
    direct = _vectors(server, "/v1/embeddings", {"messages": MESSAGES})
    np.testing.assert_allclose(_vectors(server, "/invocations", {"messages": MESSAGES}), direct, atol=1e-5)
    status, resp = server.request("POST", "/invocations", {"text_1": "a cat.", "text_2": ["a dog.", "a cat."]})
    assert status == 200 and [d["object"] for d in resp["data"]] == ["score", "score"], resp
    status, resp = server.request("POST", "/invocations", {"query": "a cat.", "documents": ["a dog.", "a cat."]})
    assert status == 200 and resp["results"][0]["index"] == 1, resp
    for body, param in (({"prompt": "hi"}, "input"), ({"input": "x", "bogus": 1}, "bogus")):
        status, resp = server.request("POST", "/invocations", body)
        assert status == 400 and resp["error"]["param"] == param, resp


def test_ping_and_invocations_on_a_generative_server(server):
    assert server.request("GET", "/ping", auth=False)[0] == 200  # public, as /health
    assert server.request("POST", "/ping", auth=False)[0] == 200
    assert server.request("POST", "/invocations", {"prompt": "hi"}, auth=False)[0] == 401
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
    status, resp = server.request("POST", "/invocations", chat)
    assert status == 200 and resp["object"] == "chat.completion" and resp["model"] == MODEL_NAME, resp
    direct = server.request("POST", "/v1/chat/completions", chat)[1]
    assert resp["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    status, resp = server.request("POST", "/invocations", {"prompt": "Hi", "max_tokens": 2, "stream": True})
    assert status == 200 and '"object":"text_completion"' in resp and resp.rstrip().endswith("data: [DONE]"), resp
    for body, param in (({"input": "x"}, "messages"), ({"prompt": "hi", "n": "x"}, "n")):
        status, resp = server.request("POST", "/invocations", body)
        assert status == 400 and resp["error"]["param"] == param, resp
    status, resp = server.request("POST", "/invocations", b"[1, 2]")
    assert status == 400, resp

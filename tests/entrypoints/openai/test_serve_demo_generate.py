"""POST /generate, the body and answer of vLLM's demo API server: greedy text equal to the offline LLM's, the NUL-
separated stream ending in the same text, and 400 for bad fields."""

from __future__ import annotations

import http.client
import json

import pytest

PROMPT = "The capital of France is"


def test_generate_equals_offline(server, offline_llm):
    from pagedllm import SamplingParams

    expected = offline_llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    want = PROMPT + expected[0].outputs[0].text
    status, body = server.request("POST", "/generate", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.0})
    assert status == 200, body
    assert body == {"text": [want]}
    status, body = server.request(
        "POST", "/generate", {"prompt": PROMPT, "max_tokens": 3, "n": 2, "temperature": 1.0, "seed": 1}
    )
    assert status == 200 and len(body["text"]) == 2 and all(t.startswith(PROMPT) for t in body["text"])


def test_generate_stream(server, offline_llm):
    from pagedllm import SamplingParams

    expected = offline_llm.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "stream": True})
    conn.request("POST", "/generate", body=body, headers=server.headers())
    resp = conn.getresponse()
    raw = resp.read().decode()
    conn.close()
    assert resp.status == 200 and raw.endswith("\0")
    chunks = [json.loads(part) for part in raw.split("\0") if part]
    assert len(chunks) >= 2  # one per step
    assert chunks[-1] == {"text": [PROMPT + expected[0].outputs[0].text]}
    assert all(len(c["text"]) == 1 and c["text"][0].startswith(PROMPT) for c in chunks)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"max_tokens": 4}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "max_tokens": 4, "bogus": 1}, "bogus"),
        ({"prompt": "x", "logits_processors": []}, "logits_processors"),
        ({"prompt": "x", "n": 1000}, "n"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "max_tokens": 100000}, "max_tokens"),
    ],
)
def test_generate_bad_bodies(server, body, param):
    status, resp = server.request("POST", "/generate", body)
    assert status == 400, resp
    assert resp["error"]["param"] == param, resp


def test_generate_needs_the_key(server):
    status, _ = server.request("POST", "/generate", {"prompt": PROMPT}, auth=False)
    assert status == 401

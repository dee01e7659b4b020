"""`pagedllm embed`: texts from .txt / .jsonl in, one JSON line per text out, embeddings as sentence-transformers'."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pagedllm.cli import main

TEXTS = ["The cat sits on the mat.", "Les chats dorment beaucoup.", "猫はよく眠る。"]


@pytest.fixture(scope="module")
def reference(minilm):
    st = pytest.importorskip("sentence_transformers")
    return st.SentenceTransformer(minilm, device="cpu").encode(TEXTS, convert_to_numpy=True)


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_embed_command_writes_one_line_per_text(tmp_path, reference, suffix):
    source = tmp_path / f"in{suffix}"
    if suffix == ".txt":
        source.write_text("\n".join(TEXTS) + "\n\n", encoding="utf-8")
    else:
        lines = [json.dumps(TEXTS[0]), json.dumps({"text": TEXTS[1]}), "", json.dumps({"prompt": TEXTS[2]})]
        source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    target = tmp_path / "out.jsonl"
    assert main(["embed", "--input", str(source), "--output", str(target)]) == 0
    records = [json.loads(line) for line in target.read_text(encoding="utf-8").splitlines()]
    assert [r["text"] for r in records] == TEXTS and [r["index"] for r in records] == [0, 1, 2]
    ours = np.array([r["embedding"] for r in records])
    cos = (ours * reference).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)
    assert cos.min() >= 0.9999


def test_embed_command_reports_bad_input(tmp_path, capsys, minilm):
    source = tmp_path / "bad.jsonl"
    source.write_text(json.dumps({"no_text": 1}) + "\n", encoding="utf-8")
    assert main(["embed", "--input", str(source)]) == 2
    assert "bad.jsonl:1: expected a JSON string or an object with a 'text' string" in capsys.readouterr().err
    long_input = tmp_path / "long.txt"
    long_input.write_text("word " * 300 + "\n", encoding="utf-8")
    assert main(["embed", "--input", str(long_input)]) == 2
    assert "prompt length 302 is longer than max_model_len=256" in capsys.readouterr().err

"""benchmarks/dummy_model.py: the word-level tokenizer beside a dummy config covers every id of the vocabulary,
decodes each id to its own word and marks the config's bos/eos ids special (the serving benchmark's stream needs
text for every token)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.dummy_model import with_tokenizer  # noqa: E402
from pagedllm.tokenizer import get_tokenizer  # noqa: E402


def test_every_id_decodes_to_its_word(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "bos_token_id": 1, "eos_token_id": 2}
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(config))
    folder = with_tokenizer(str(tmp_path / "cfg"), str(tmp_path / "model"))
    assert json.loads((Path(folder) / "config.json").read_text()) == config
    tok = get_tokenizer(folder, None, False)
    assert len(tok) == 300
    assert sorted(tok.all_special_ids) == [1, 2]
    assert tok.decode([5, 299, 17]) == "w5 w299 w17"
    assert tok.decode([5, 2], skip_special_tokens=True) == "w5"
    assert tok.encode("w7 w8", add_special_tokens=False) == [7, 8]

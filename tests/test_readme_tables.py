"""README.md's architectures table is what scripts/readme_tables.py writes from the model registry."""

from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("readme_tables", ROOT / "scripts" / "readme_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_architectures_table_is_current():
    script = _script()
    text = (ROOT / "README.md").read_text()
    assert script.rewrite(text) == text, "README.md's architectures table is stale: run python scripts/readme_tables.py"


def test_table_lists_every_native_architecture_once():
    from pagedllm.models.registry import native_architectures

    script = _script()
    table = script.architectures_table().splitlines()[2:]
    assert [row.split("`")[1] for row in table] == native_architectures()
    stale = script.rewrite((ROOT / "README.md").read_text()).replace("| `BloomForCausalLM` |", "| `Bloom` |")
    assert script.rewrite(stale) != stale  # a hand-edited table is caught

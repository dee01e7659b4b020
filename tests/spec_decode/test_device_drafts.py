"""DeviceDrafts (spec_decode/device_drafts.py): the scheduler's placeholders, the verify step's input ids filled
from the device tensor at the right places of the flat batch, and the values read back for the host's checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.spec_decode.device_drafts import UNKNOWN, DeviceDrafts, resolve


def make() -> DeviceDrafts:
    return DeviceDrafts(["a", "b"], torch.tensor([[11, 12, 13], [21, 22, 23]]))


def test_placeholders_and_values():
    drafts = make()
    assert dict(drafts) == {"a": [UNKNOWN] * 3, "b": [UNKNOWN] * 3} and len(drafts) == 2
    assert drafts.get("c", []) == [] and "c" not in drafts
    assert drafts.tokens_of("b") == [21, 22, 23]
    with pytest.raises(KeyError):
        drafts.tokens_of("c")


def test_fill_inputs_places_each_requests_drafts_at_the_end_of_its_tokens():
    """Flat batch: request x (5 tokens, no drafts), b (2 known + 2 of its 3 drafts: cut by the budget), y (3 tokens
    with real drafts, e.g. a constrained request's), a (1 known + 3 drafts)."""
    drafts = make()
    req_ids = ["x", "b", "y", "a"]
    spec = [[], [UNKNOWN, UNKNOWN], [7, 8], [UNKNOWN] * 3]
    query_end = np.array([5, 9, 12, 16])
    input_ids = torch.zeros(16, dtype=torch.int64)
    places, values = drafts.fill_inputs(req_ids, spec, query_end)
    input_ids.index_copy_(0, places, values)
    expected = np.zeros(16, dtype=np.int64)
    expected[7:9] = [21, 22]
    expected[13:16] = [11, 12, 13]
    assert input_ids.tolist() == expected.tolist()
    assert drafts.fill_inputs(["x", "y"], [[], [7, 8]], np.array([5, 8])) is None


def test_resolve_reads_only_the_placeholders_it_is_asked_for():
    drafts = make()
    spec = {"a": [UNKNOWN, UNKNOWN], "b": [UNKNOWN] * 3, "y": [7, 8]}
    resolve(spec, drafts, ["a", "y"])
    assert spec == {"a": [11, 12], "b": [UNKNOWN] * 3, "y": [7, 8]}

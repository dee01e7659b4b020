"""LoRAManager's device slots (at most max_loras, least recently used given up first, never one the step needs) and
host copies (an LRU of max_cpu_loras; an evicted adapter is read again from its folder)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.layers.build_context import BuildContext, building
from pagedllm.layers.linear import QKVParallelLinear
from pagedllm.lora.config import LoRAConfig
from pagedllm.lora.manager import LoRAManager
from pagedllm.lora.mapping import StaticLoRAMapping, block_layout
from pagedllm.lora.peft_adapter import PEFTAdapter
from pagedllm.lora.request import LoRARequest


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with building(BuildContext(tp_rank=0, tp_size=1)):
            self.qkv_proj = QKVParallelLinear(8, 2, 2, 1, bias=False)  # q 4 rows, k 2, v 2


@pytest.fixture
def manager(monkeypatch):
    reads: list[str] = []

    def fake_load(path: str, max_rank: int) -> PEFTAdapter:  # adapter i: A = i, B = 1 on q; scaling 1
        reads.append(path)
        i = float(path.rsplit("/", 1)[-1])
        return PEFTAdapter(path, {}, {"q_proj": (torch.full((2, 8), i), torch.ones(4, 2), 1.0)})

    monkeypatch.setattr("pagedllm.lora.manager.load_peft_adapter", fake_load)
    model = Tiny()
    model.stacked = [(".qkv_proj.", ".q_proj.", "q")]
    m = LoRAManager(
        model, LoRAConfig(max_loras=2, max_lora_rank=2, max_cpu_loras=3), torch.float32, torch.device("cpu")
    )
    for i in range(1, 5):
        m.add(LoRARequest(f"a{i}", i, f"/adapters/{i}"))
    m.reads = reads
    return m


def slot_value(m: LoRAManager, slot: int) -> float:
    return float(m.lora_model.layers["qkv_proj"].a[slot, 0, 0])


def test_slots_least_recently_used_and_never_the_steps_own(manager):
    assert manager.slots_for([1, 2]) == {1: 0, 2: 1}
    assert manager.slots_for([2]) == {2: 1}  # 2 used last: 1 is the least recent
    assert manager.slots_for([3]) == {3: 0}
    assert (slot_value(manager, 0), slot_value(manager, 1)) == (3.0, 2.0)
    assert manager.slots_for([2, 4]) == {2: 1, 4: 0}  # 3's slot goes, 2 stays where it is
    with pytest.raises(RuntimeError, match="max_loras=2"):
        manager.slots_for([1, 2, 3])


def test_host_copies_are_an_lru_and_evicted_ones_are_read_again(manager):
    assert manager.reads == ["/adapters/1", "/adapters/2", "/adapters/3", "/adapters/4"]
    assert list(manager.host) == [2, 3, 4]  # max_cpu_loras=3: adapter 1's copy went
    manager.slots_for([1])
    assert manager.reads[-1] == "/adapters/1" and slot_value(manager, 0) == 1.0
    with pytest.raises(ValueError, match="lora_int_id=2 is already used"):
        manager.add(LoRARequest("other", 2, "/adapters/other"))
    assert manager.add(LoRARequest("a2", 2, "/adapters/2")) is False


def test_mapping_groups_tokens_by_slot(manager):
    mapping = manager.mapping(np.array([0, 3, 1, 3, 0, 1]))
    slots = manager.slots_for([1, 3])
    by_slot = {s: idx.tolist() for s, idx in mapping.groups}
    assert by_slot == {slots[1]: [2, 5], slots[3]: [1, 3]}
    first, count, slot = mapping.blocks[:, : mapping.num_blocks].tolist()  # (the table's width is padded)
    assert slot == sorted(slots.values()) and count == [2, 2]
    assert [mapping.sorted_tokens[f : f + c].tolist() for f, c in zip(first, count)] == [by_slot[s] for s in slot]
    assert manager.mapping(np.zeros(4, dtype=np.int64)) is None


def test_block_layout_cuts_groups_into_token_blocks():
    """40 tokens: 20 of slot 2, 17 of slot 0, 3 base; blocks of at most BLOCK_M=16 tokens of one slot."""
    token_slots = np.array([2] * 20 + [-1] * 3 + [0] * 17)
    sorted_tokens, blocks, group_slots = block_layout(token_slots)
    assert sorted_tokens.tolist() == list(range(23, 40)) + list(range(20))
    assert blocks.tolist() == [[0, 16, 17, 33], [16, 1, 16, 4], [0, 0, 2, 2]]
    assert group_slots.tolist() == [0, 2]


def test_static_mapping_refills_fixed_buffers():
    static = StaticLoRAMapping(max_tokens=8, max_loras=2, device=torch.device("cpu"))
    view, address = static.view(4), static.dev.data_ptr()
    assert view.num_blocks == 1 + 2  # cdiv(4, 16) blocks + one per slot: any mix fits
    static.load(np.array([1, -1, 0, 1]), 4)
    assert view.token_slots.tolist() == [1, -1, 0, 1]
    assert view.blocks[:, :3].tolist() == [[0, 1, 0], [1, 2, 0], [0, 1, 0]]
    assert view.sorted_tokens[:3].tolist() == [2, 0, 3]
    static.load(None, 3)  # no adapter: every block empty, every token on the base
    assert view.token_slots.tolist() == [-1] * 4 and not view.blocks[1].any()
    assert static.dev.data_ptr() == address

"""Which row-parallel all-reduces a tensor-parallel model leaves to the RMSNorm after them (LlamaModel.
defer_reductions): every o_proj and down_proj of a plain Llama-family layer, except where the output goes elsewhere
first (a stage's last layer before the next stage, a layer whose input EAGLE-3 copies) or a family runs its own
forward. The engine tests (tests/distributed/test_tp_*.py) check that the sums stay right; this checks the wiring."""

from __future__ import annotations

import pytest
from transformers import Gemma2Config, GemmaConfig, LlamaConfig, Qwen3Config

from pagedllm.layers.build_context import BuildContext, building
from pagedllm.models.registry import get_model_class

GROUP = object()  # stands for the tensor-parallel Communicator (never called while building)


def _decoder(config, architecture: str, tp: int = 2, pp_rank: int = 0, pp: int = 1):
    config.architectures = [architecture]
    with building(BuildContext(tp_rank=0, tp_size=tp, tp_group=GROUP, pp_rank=pp_rank, pp_size=pp)):
        model = get_model_class(architecture)(config, max_position=64)
    return getattr(model, model.model_attr)


def _tiny(cls, **kw):
    return cls(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=128, **kw)  # fmt: skip


def _wiring(decoder) -> list[tuple]:
    """Per layer: (o_proj reduces, post-attention norm reduces, down_proj reduces, next norm reduces)."""
    rows = []
    for i in range(decoder.first, decoder.last):
        layer = decoder.layers[i]
        nxt = decoder.layers[i + 1].input_layernorm if i + 1 < decoder.last else decoder.norm
        rows.append((
            layer.self_attn.o_proj.reduce_results, layer.post_attention_layernorm.reduce_group is GROUP,
            layer.mlp.down_proj.reduce_results, getattr(nxt, "reduce_group", None) is GROUP,
        ))  # fmt: skip
    return rows


@pytest.mark.parametrize(
    ("cls", "architecture"),
    [(LlamaConfig, "LlamaForCausalLM"), (Qwen3Config, "Qwen3ForCausalLM"), (GemmaConfig, "GemmaForCausalLM")],
)
def test_every_layer_leaves_its_sums_to_the_next_norm(cls, architecture):
    decoder = _decoder(_tiny(cls), architecture)
    assert _wiring(decoder) == [(False, True, False, True)] * 4
    assert decoder.layers[0].input_layernorm.reduce_group is None  # the embedding's output is whole


def test_one_rank_defers_nothing():
    decoder = _decoder(_tiny(LlamaConfig), "LlamaForCausalLM", tp=1)
    assert _wiring(decoder) == [(True, False, True, False)] * 4


def test_a_stage_sends_whole_sums_to_the_next():
    first = _decoder(_tiny(LlamaConfig), "LlamaForCausalLM", pp_rank=0, pp=2)
    assert _wiring(first) == [(False, True, False, True), (False, True, True, False)]
    last = _decoder(_tiny(LlamaConfig), "LlamaForCausalLM", pp_rank=1, pp=2)
    assert _wiring(last) == [(False, True, False, True)] * 2
    assert last.layers[2].input_layernorm.reduce_group is None  # its input came whole from the first stage


def test_layers_copied_by_eagle3_get_whole_inputs():
    decoder = _decoder(_tiny(LlamaConfig), "LlamaForCausalLM")
    decoder.aux_hidden_state_layers = (0, 2)
    decoder.defer_reductions()
    deferred, whole = (False, True, False, True), (False, True, True, False)
    assert _wiring(decoder) == [deferred, whole, deferred, deferred]  # layer 2's input: layer 1's output, summed


def test_a_family_with_its_own_layer_forward_keeps_plain_all_reduces():
    decoder = _decoder(_tiny(Gemma2Config), "Gemma2ForCausalLM")  # norms after the attention and MLP as well
    assert _wiring(decoder) == [(True, False, True, False)] * 4

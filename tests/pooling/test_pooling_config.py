"""Which runner a model gets for each task / runner / convert (vLLM's rules), and pooler_config validation."""

from __future__ import annotations

import pytest

from pagedllm.pooling.config import PoolerConfig, resolve_runner


@pytest.mark.parametrize(
    "arch, kwargs, expected",
    [
        ("BertModel", {}, ("pooling", "embed")),
        ("BertModel", {"task": "embed"}, ("pooling", "embed")),
        ("BertModel", {"task": "embedding"}, ("pooling", "embed")),
        ("BertModel", {"task": "score"}, ("pooling", "embed")),
        ("BertModel", {"runner": "pooling", "convert": "embed"}, ("pooling", "embed")),
        ("BertForSequenceClassification", {}, ("pooling", "classify")),
        ("BertForSequenceClassification", {"task": "score"}, ("pooling", "classify")),
        ("BertForSequenceClassification", {"convert": "classify"}, ("pooling", "classify")),
        ("XLMRobertaModel", {}, ("pooling", "embed")),
        ("RobertaModel", {"task": "embed"}, ("pooling", "embed")),
        ("XLMRobertaForSequenceClassification", {}, ("pooling", "classify")),
        ("RobertaForSequenceClassification", {"task": "score"}, ("pooling", "classify")),
        ("MistralModel", {}, ("pooling", "embed")),
        ("Qwen2Model", {"task": "embed"}, ("pooling", "embed")),
        ("LlamaModel", {"runner": "pooling"}, ("pooling", "embed")),
        ("Qwen3Model", {"task": "score"}, ("pooling", "embed")),
        ("LlamaForCausalLM", {}, ("generate", None)),
        ("LlamaForCausalLM", {"task": "generate"}, ("generate", None)),
        ("LlamaForCausalLM", {"task": "embed"}, ("pooling", "embed")),
        ("Qwen3ForCausalLM", {"task": "score"}, ("pooling", "embed")),
        ("Qwen2ForCausalLM", {"runner": "pooling"}, ("pooling", "embed")),
        ("MistralForCausalLM", {"convert": "embed"}, ("pooling", "embed")),
    ],
)
def test_runner_of_each_request(arch, kwargs, expected):
    args = {"task": None, "runner": None, "convert": None, **kwargs}
    assert resolve_runner(arch, args["task"], args["runner"], args["convert"]) == expected


@pytest.mark.parametrize(
    "arch, kwargs, message",
    [
        ("BertModel", {"task": "generate"}, r"task/runner='generate': BertModel is a pooling model"),
        ("BertModel", {"runner": "generate"}, r"task/runner='generate'"),
        ("BertModel", {"task": "classify"}, r"task='classify': BertModel is an embedding model"),
        ("BertForSequenceClassification", {"task": "embed"}, r"is a classification model"),
        ("XLMRobertaForSequenceClassification", {"task": "embed"}, r"is a classification model"),
        ("XLMRobertaModel", {"task": "classify"}, r"XLMRobertaModel is an embedding model"),
        ("Qwen2Model", {"task": "classify"}, r"Qwen2Model is an embedding model"),
        ("MistralModel", {"runner": "generate"}, r"MistralModel is a pooling model"),
        ("LlamaForCausalLM", {"task": "classify"}, r"LlamaForCausalLM has no classification head"),
        ("LlamaForCausalLM", {"runner": "generate", "convert": "embed"}, r"contradict each other"),
        ("LlamaForCausalLM", {"runner": "pooling", "convert": "none"}, r"convert='none': LlamaForCausalLM"),
        ("LlamaForCausalLM", {"task": "reward"}, r"task='reward' must be one of"),
        ("LlamaForCausalLM", {"runner": "draft"}, r"runner='draft' must be one of"),
        ("LlamaForCausalLM", {"convert": "reward"}, r"convert='reward' must be one of"),
    ],
)
def test_contradictions_are_refused(arch, kwargs, message):
    args = {"task": None, "runner": None, "convert": None, **kwargs}
    with pytest.raises(ValueError, match=message):
        resolve_runner(arch, args["task"], args["runner"], args["convert"])


def test_pooler_config():
    assert PoolerConfig.from_user({"pooling_type": "mean"}).pooling_type == "MEAN"
    assert PoolerConfig.from_user(None) == PoolerConfig()
    with pytest.raises(ValueError, match=r"pooler_config.pooling_type='STEP' must be one of"):
        PoolerConfig(pooling_type="STEP")
    with pytest.raises(ValueError, match=r"pooler_config has unknown keys \['softmax'\]"):
        PoolerConfig.from_user({"softmax": True})
    with pytest.raises(ValueError, match=r"pooler_config.normalize=1 must be None, True or False"):
        PoolerConfig(normalize=1)

"""Which runner a model gets for each task / runner / convert (vLLM's rules), and pooler_config validation."""

from __future__ import annotations

import pytest

from pagedllm.pooling.config import PoolerConfig, classify_activation, resolve_runner, score_activation


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
        ("Qwen2ForSequenceClassification", {}, ("pooling", "classify")),
        ("LlamaForSequenceClassification", {"task": "score"}, ("pooling", "classify")),
        ("BertForTokenClassification", {"runner": "pooling"}, ("pooling", "token_classify")),
        ("XLMRobertaForTokenClassification", {}, ("pooling", "token_classify")),
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
        ("Qwen3ForSequenceClassification", {"task": "embed"}, r"is a classification model"),
        ("BertForTokenClassification", {"task": "classify"}, r"is a token classification model"),
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


@pytest.mark.parametrize(
    "fields, classify, score",
    [
        ({}, "auto", "auto"),
        ({"problem_type": "regression"}, "identity", "auto"),
        ({"problem_type": "multi_label_classification"}, "sigmoid", "auto"),
        ({"problem_type": "single_label_classification"}, "auto", "auto"),
        ({"sbert_ce_default_activation_function": "torch.nn.modules.linear.Identity"}, "auto", "identity"),
        ({"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Sigmoid"}}, "auto", "auto"),
        ({"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Tanh"}}, "auto", "tanh"),
    ],
)
def test_classifier_activations_follow_the_config(fields, classify, score):
    """vLLM's rules: classify by HF's problem_type, score by sentence-transformers' cross-encoder activation."""
    from types import SimpleNamespace

    config = SimpleNamespace(**fields)
    assert (classify_activation(config), score_activation(config)) == (classify, score)


def test_unknown_cross_encoder_activation_is_refused():
    from types import SimpleNamespace

    config = SimpleNamespace(sbert_ce_default_activation_function="os.system")
    with pytest.raises(ValueError, match=r"cross-encoder activation 'os.system' is not supported"):
        score_activation(config)

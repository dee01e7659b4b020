"""The speculative-decoding options as the user gives them: vLLM's speculative_config dict, the older keywords and the
server flag; bad values are ValueErrors naming the field."""

from __future__ import annotations

import pytest

from pagedllm.cli import build_parser
from pagedllm.engine_args import EngineArgs
from pagedllm.spec_decode import SpeculativeConfig


def test_the_dict_and_the_older_keywords_give_the_same_config():
    new = SpeculativeConfig.from_user(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    )
    old = SpeculativeConfig.from_user(None, "[ngram]", 4, 3, 2)
    assert new == old == SpeculativeConfig("ngram", 4, 3, 2)
    assert SpeculativeConfig.from_user({"model": "[ngram]", "num_speculative_tokens": 2}).method == "ngram"
    assert SpeculativeConfig.from_user() is None


def test_lookup_bounds_default_from_each_other():
    assert (SpeculativeConfig(num_speculative_tokens=2).prompt_lookup_min, 1) == (1, 1)
    only_max = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=4)
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    only_min = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=2)
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (2, 2)


@pytest.mark.parametrize(
    "config, match",
    [
        ({"method": "medusa", "num_speculative_tokens": 3}, "method='medusa' is not implemented yet"),
        ({"method": "eagle", "num_speculative_tokens": 3}, "method='eagle' needs model"),
        ({"method": "eagle3", "model": "", "num_speculative_tokens": 3}, "method='eagle3' needs model"),
        ({"method": "draft_model", "num_speculative_tokens": 3}, "method='draft_model' needs model"),
        ({"method": "ngram", "model": "a/draft", "num_speculative_tokens": 3}, "'ngram' takes no model"),
        ({"method": "draft_model", "model": "a/draft"}, "needs num_speculative_tokens"),
        ({"num_speculative_tokens": 2, "draft_model_config": 1}, r"unknown field\(s\) \['draft_model_config'\]"),
        ({"method": "lookahead", "num_speculative_tokens": 3}, "method='lookahead' is not a method"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0 must be an integer >= 1"),
        ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens=2.5 must be an integer"),
        ({"num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max=0 must be an integer >= 1"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min=4 must"),
        ({"num_speculative_tokens": 2, "disable_by_batch_size": -1}, "disable_by_batch_size=-1"),
        ({"num_speculative_tokens": 2, "lookup": 3}, r"unknown field\(s\) \['lookup'\]"),
        (
            {"method": "draft_model", "model": "a/draft", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
            r"draft_tensor_parallel_size=2: the draft model runs whole on the first rank \(allowed: 1\)",
        ),
        (
            {"num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
            "applies to method='draft_model', not 'ngram'",
        ),
        ("ngram", "must be a dict"),
    ],
)
def test_bad_config(config, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_user(config)


def test_draft_model_in_the_dict_and_the_older_keywords():
    new = SpeculativeConfig.from_user({"method": "draft_model", "model": "a/draft", "num_speculative_tokens": 3})
    older_dict = SpeculativeConfig.from_user({"model": "a/draft", "num_speculative_tokens": 3})
    old = SpeculativeConfig.from_user(None, "a/draft", 3)
    assert new == older_dict == old and (old.method, old.model, old.num_speculative_tokens) == (
        "draft_model",
        "a/draft",
        3,
    )


def test_eagle_heads_are_detected_by_name_as_vllm_does():
    eagle = SpeculativeConfig.from_user({"model": "yuhuili/EAGLE-LLaMA3-Instruct-8B", "num_speculative_tokens": 3})
    eagle3 = SpeculativeConfig.from_user(None, "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", 2)
    assert (eagle.method, eagle.model) == ("eagle", "yuhuili/EAGLE-LLaMA3-Instruct-8B")
    assert (eagle3.method, eagle3.num_speculative_tokens) == ("eagle3", 2)
    explicit = SpeculativeConfig.from_user({"method": "eagle3", "model": "a/head", "num_speculative_tokens": 1})
    assert explicit.method == "eagle3"


def test_bad_older_keywords():
    with pytest.raises(ValueError, match=r"\['ngram_prompt_lookup_max'\] are options of speculative_model='\[ngram\]'"):
        SpeculativeConfig.from_user(None, "some/model", 3, 2)
    with pytest.raises(ValueError, match=r"\['num_speculative_tokens'\] need speculative_model='\[ngram\]'"):
        SpeculativeConfig.from_user(None, None, 3)
    with pytest.raises(ValueError, match="not both"):
        SpeculativeConfig.from_user({"num_speculative_tokens": 2}, "[ngram]", 2)


def test_engine_args_check_before_loading():
    # the model does not exist: the speculative config is checked first
    with pytest.raises(ValueError, match="method='medusa' is not implemented yet"):
        EngineArgs(model="/nonexistent", speculative_config={"method": "medusa"}).create_engine_config()


def test_the_server_flag_takes_json():
    flag = '{"method": "ngram", "num_speculative_tokens": 3}'
    args = build_parser().parse_args(["serve", "--speculative-config", flag])
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", "{method: ngram}"])


def test_speculative_disable_by_batch_size_keyword():
    """vLLM's older speculative_disable_by_batch_size sets the config's disable_by_batch_size; it goes with the
    other older keywords only."""
    old = SpeculativeConfig.from_user(None, "[ngram]", 4, None, None, 8)
    assert old == SpeculativeConfig.from_user(
        {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 8}
    )
    assert SpeculativeConfig.from_user(None, "a/draft", 3, None, None, 2).disable_by_batch_size == 2
    with pytest.raises(ValueError, match="not both"):
        SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 4}, None, None, None, None, 8)
    with pytest.raises(ValueError, match="speculative_model"):
        SpeculativeConfig.from_user(None, None, None, None, None, 8)
    with pytest.raises(ValueError, match="disable_by_batch_size=0"):
        SpeculativeConfig.from_user(None, "[ngram]", 4, None, None, 0)

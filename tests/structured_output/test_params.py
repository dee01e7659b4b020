"""GuidedDecodingParams / StructuredOutputsParams and their SamplingParams fields: exactly one constraint, types
checked, the two names one field."""

from __future__ import annotations

import pytest

from pagedllm import GuidedDecodingParams, SamplingParams, StructuredOutputsParams


def test_each_kind_and_both_names():
    for kwargs, kind in [
        ({"json": {"type": "object"}}, "json"),
        ({"json": '{"type": "integer"}'}, "json"),
        ({"regex": "a+"}, "regex"),
        ({"choice": ["a", "b"]}, "choice"),
        ({"grammar": 'root ::= "a"'}, "grammar"),
        ({"json_object": True}, "json_object"),
        ({"structural_tag": '{"type": "structural_tag"}'}, "structural_tag"),
    ]:
        assert StructuredOutputsParams(**kwargs).kind == kind
        old = SamplingParams(guided_decoding=GuidedDecodingParams(**kwargs))
        new = SamplingParams(structured_outputs=StructuredOutputsParams(**kwargs))
        assert old.structured_outputs is old.guided_decoding and old.structured_outputs.kind == kind
        assert new.guided_decoding is new.structured_outputs and new.structured_outputs.kind == kind
    assert SamplingParams(structured_outputs={"regex": "x"}).structured_outputs == StructuredOutputsParams(regex="x")


def test_pydantic_model_class_is_its_schema():
    pydantic = pytest.importorskip("pydantic")

    class Point(pydantic.BaseModel):
        x: int
        y: int

    assert GuidedDecodingParams(json=Point).json == Point.model_json_schema()


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({}, "exactly one"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({"json_object": False}, "exactly one"),
        ({"json": 3}, "guided_decoding.json"),
        ({"regex": 5}, "guided_decoding.regex"),
        ({"regex": ""}, "guided_decoding.regex"),
        ({"choice": []}, "guided_decoding.choice"),
        ({"choice": ["a", 1]}, "guided_decoding.choice"),
        ({"choice": "ab"}, "guided_decoding.choice"),
        ({"grammar": ["x"]}, "guided_decoding.grammar"),
        ({"regex": "a", "backend": "outlines"}, "guided_decoding.backend"),
        ({"regex": "a", "whitespace_pattern": " *"}, "guided_decoding.whitespace_pattern"),
        ({"regex": "a", "disable_any_whitespace": "yes"}, "guided_decoding.disable_any_whitespace"),
        ({"regex": "a", "disable_any_whitespace": True}, "guided_decoding.disable_any_whitespace"),
    ],
)
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        GuidedDecodingParams(**kwargs)


def test_sampling_params_checks():
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        StructuredOutputsParams(regex=1)
    with pytest.raises(ValueError, match="same field"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"), guided_decoding={"regex": "b"})
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs="a+")
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a", "bogus": 1})
    with pytest.raises(ValueError, match="use_beam_search"):
        SamplingParams(structured_outputs={"regex": "a"}, use_beam_search=True, best_of=2, temperature=0, n=1)


def test_clone_keeps_the_constraint_apart():
    params = SamplingParams(structured_outputs={"json": {"type": "object"}})
    copy = params.clone()
    copy.structured_outputs.json["type"] = "array"
    assert params.structured_outputs.json == {"type": "object"}

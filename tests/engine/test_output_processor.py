"""OutputProcessor with several tokens per step (accepted drafts): text, stop strings, logprobs and token counts."""

from __future__ import annotations

from pagedllm.engine.output_processor import OutputProcessor, RequestState, SequenceState
from pagedllm.engine.scheduler import EngineCoreOutput
from pagedllm.sampling_params import SamplingParams


class LetterTokenizer:
    """Token t is the letter chr(ord('a') + t)."""

    def decode(self, ids, skip_special_tokens=True, spaces_between_special_tokens=True) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids)


def processor_with(params: SamplingParams) -> OutputProcessor:
    processor = OutputProcessor(LetterTokenizer())
    seq = SequenceState(0, [0], params, processor.tokenizer, params.logprobs is not None)
    processor.add_request(RequestState("r", None, [0], 1, {"r": seq}))
    return processor


def entries(tokens: list[int]) -> list[tuple[list[int], list[float], list[int]]]:
    return [([t], [-0.25 * (i + 1)], [1]) for i, t in enumerate(tokens)]


def core_output(tokens, finish_reason=None, stop_reason=None, logprobs=True) -> EngineCoreOutput:
    return EngineCoreOutput("r", tokens, finish_reason, stop_reason, 0, entries(tokens) if logprobs else None)


def test_several_tokens_in_one_step_add_their_text_and_logprobs():
    processor = processor_with(SamplingParams(max_tokens=10, logprobs=0))
    finished, to_abort = processor.process([core_output([1, 2, 3])])  # "bcd"
    assert finished == [] and to_abort == []
    (out,) = processor.unfinished_outputs()
    c = out.outputs[0]
    assert c.token_ids == [1, 2, 3] and c.text == "bcd"
    assert [list(d) for d in c.logprobs] == [[1], [2], [3]] and c.cumulative_logprob == -1.5
    assert processor.stats.generation_tokens == 3


def test_a_stop_string_inside_the_step_drops_the_tokens_after_it():
    processor = processor_with(SamplingParams(max_tokens=10, logprobs=0, stop=["cd"]))
    processor.process([core_output([1])])  # "b"
    finished, to_abort = processor.process([core_output([2, 3, 4, 5])])  # "cdef": the stop ends at token 3
    assert to_abort == ["r"]
    c = finished[0].outputs[0]
    assert c.token_ids == [1, 2, 3] and c.text == "b" and (c.finish_reason, c.stop_reason) == ("stop", "cd")
    assert len(c.logprobs) == 3 and c.cumulative_logprob == -0.25 - 0.25 - 0.5  # the step's first two entries
    assert processor.stats.generation_tokens == 3


def test_a_stop_token_ending_the_step_adds_no_text():
    processor = processor_with(SamplingParams(max_tokens=10, stop_token_ids=[4]))
    (out,), _ = processor.process([core_output([1, 2, 4], "stop", 4, logprobs=False)])
    c = out.outputs[0]
    assert c.token_ids == [1, 2, 4] and c.text == "bc" and (c.finish_reason, c.stop_reason) == ("stop", 4)

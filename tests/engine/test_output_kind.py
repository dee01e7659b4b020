"""SamplingParams.output_kind (vLLM's RequestOutputKind): what each output of LLMEngine.step() carries. CUMULATIVE:
everything so far; DELTA: only what is new (the deltas concatenate to the cumulative result, held-back text that
may begin a stop string comes later and never the stop string itself); FINAL_ONLY: the finished output only.
LLM.generate returns whole outputs whatever the params ask. OutputProcessor cases on a letter tokenizer, then the
engine on tiny random Llamas (token ids only, and a character-level tokenizer for stop strings)."""

from __future__ import annotations

import pytest
import transformers
from char_tokenizer import save_char_llama
from tiny_models import TINY_DECODER, save_tiny_decoder

from pagedllm import LLM, SamplingParams
from pagedllm.engine.output_processor import OutputProcessor, RequestState, SequenceState
from pagedllm.engine.scheduler import EngineCoreOutput
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import RequestOutputKind

DELTA, CUMULATIVE, FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY


class LetterTokenizer:
    """Token t is the letter chr(ord('a') + t)."""

    def decode(self, ids, skip_special_tokens=True, spaces_between_special_tokens=True) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids)


def processor_with(params: SamplingParams) -> OutputProcessor:
    processor = OutputProcessor(LetterTokenizer())
    seq = SequenceState(0, [0], params, processor.tokenizer, params.logprobs is not None)
    processor.add_request(RequestState("r", None, [0], 1, {"r": seq}))
    return processor


def step(processor: OutputProcessor, tokens: list[int], finish_reason=None, **kw) -> list[RequestOutput]:
    entries = [([t], [-0.5], [1]) for t in tokens]
    finished, _ = processor.process([EngineCoreOutput("r", tokens, finish_reason, None, 0, entries, **kw)])
    return finished + processor.unfinished_outputs()


def test_values_and_import_paths_are_vllms():
    from pagedllm.sampling_params import RequestOutputKind as Kind

    assert (Kind.CUMULATIVE, Kind.DELTA, Kind.FINAL_ONLY) == (0, 1, 2)
    assert SamplingParams().output_kind is Kind.CUMULATIVE
    assert SamplingParams(output_kind=1).output_kind is Kind.DELTA  # its int value, as an IntEnum


@pytest.mark.parametrize("bad", [3, -1, "DELTA", 1.0, True, None])
def test_a_bad_output_kind_is_a_value_error_naming_the_field(bad):
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=bad)


def test_delta_with_best_of_beyond_n_is_refused():
    with pytest.raises(ValueError, match="output_kind.*best_of"):
        SamplingParams(n=1, best_of=3, output_kind=DELTA)
    SamplingParams(n=2, best_of=2, output_kind=DELTA)


def test_delta_holds_back_a_possible_stop_string_then_emits_it():
    processor = processor_with(SamplingParams(max_tokens=5, stop=["cdx"], logprobs=0, output_kind=DELTA))
    texts, ids = [], []
    for tokens, reason in (([1], None), ([2], None), ([3], None), ([4], None), ([5], "length")):
        (out,) = step(processor, tokens, reason)
        c = out.outputs[0]
        texts.append(c.text)
        ids += c.token_ids
        assert c.token_ids == tokens and len(c.logprobs) == 1 and c.cumulative_logprob == -0.5 * len(ids)
    assert texts == ["b", "", "", "cde", "f"]  # "c" and "cd" may begin "cdx": shown once "e" rules it out
    assert ids == [1, 2, 3, 4, 5] and out.finished and out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("include", [False, True])
def test_delta_never_shows_the_stop_string_unless_asked(include):
    params = SamplingParams(max_tokens=9, stop=["cd"], include_stop_str_in_output=include, output_kind=DELTA)
    processor = processor_with(params)
    texts = [o.outputs[0].text for tokens in ([1], [2]) for o in step(processor, tokens)]
    (last,) = step(processor, [3, 4])  # "de": the stop ends at token 3, token 4 is dropped
    c = last.outputs[0]
    assert texts == ["b", ""] and last.finished and (c.finish_reason, c.stop_reason) == ("stop", "cd")
    assert "".join(texts) + c.text == ("bcd" if include else "b") and c.token_ids == [3]


def test_prompt_logprobs_come_once_in_delta_and_every_time_in_cumulative():
    for kind, expected in ((DELTA, [True, False, False]), (CUMULATIVE, [True, True, True])):
        processor = processor_with(SamplingParams(max_tokens=3, prompt_logprobs=0, output_kind=kind))
        prompt = (0, [([0], [-1.0], [1])])
        outs = [step(processor, [1], prompt_logprobs=prompt)[0]] + [step(processor, [2])[0]]
        outs += step(processor, [3], "length")
        assert [o.prompt_logprobs is not None for o in outs] == expected
        assert all(o.prompt_token_ids == [0] for o in outs)  # the prompt itself is in every output, as in vLLM


def test_final_only_gives_the_finished_output_alone():
    processor = processor_with(SamplingParams(max_tokens=3, output_kind=FINAL_ONLY))
    assert step(processor, [1]) == [] and step(processor, [2]) == []
    (out,) = step(processor, [3], "length")
    assert out.finished and out.outputs[0].text == "bcd" and out.outputs[0].token_ids == [1, 2, 3]


def test_request_output_add_appends_deltas_and_replaces_cumulative_outputs():
    def output(text, ids, index=0, finished=False):
        return RequestOutput("r", None, [0], [CompletionOutput(index, text, ids)], finished)

    merged = output("ab", [1, 2])
    merged.add(output("c", [3], index=1), aggregate=True)
    merged.add(output("d", [4], finished=True), aggregate=True)
    assert [(c.index, c.text, c.token_ids) for c in merged.outputs] == [(0, "abd", [1, 2, 4]), (1, "c", [3])]
    assert merged.finished
    merged.add(output("xyz", [7, 8, 9]), aggregate=False)
    assert merged.outputs[0].text == "xyz" and merged.finished


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    _, path = save_tiny_decoder(
        "llama", transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(TINY_DECODER), tmp_path_factory
    )
    return LLM(path, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=8 << 20)


@pytest.fixture(scope="module")
def char_llm(tmp_path_factory):
    path = save_char_llama("kind_char_llama", tmp_path_factory)
    return LLM(path, dtype="float32", kv_cache_memory_bytes=8 << 20)


def stream(engine, prompt, params: SamplingParams) -> list[RequestOutput]:
    engine.add_request("k", prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == "k"]
    return outs


def joined(deltas: list[RequestOutput]) -> dict[int, tuple[str, list[int], list]]:
    """Each sequence's deltas concatenated: index -> (text, token ids, logprob entries)."""
    seqs: dict[int, tuple[str, list[int], list]] = {}
    for out in deltas:
        for c in out.outputs:
            text, ids, lps = seqs.get(c.index, ("", [], []))
            seqs[c.index] = (text + c.text, ids + c.token_ids, lps + (c.logprobs or []))
    return seqs


def whole(out: RequestOutput) -> dict[int, tuple[str, list[int], list]]:
    return {c.index: (c.text, c.token_ids, c.logprobs or []) for c in out.outputs}


SEEDED = dict(temperature=1.0, seed=5, max_tokens=7, ignore_eos=True)


@pytest.mark.parametrize("fields", [dict(SEEDED, logprobs=2), dict(SEEDED, n=2, logprobs=1)], ids=["n1", "n2"])
def test_step_deltas_concatenate_to_the_cumulative_result(llm, fields):
    engine, prompt = llm.llm_engine, [5, 9, 2, 7]
    cumulative = stream(engine, prompt, SamplingParams(**fields))
    deltas = stream(engine, prompt, SamplingParams(**fields, output_kind=DELTA))
    assert len(deltas) == len(cumulative) == 7 and deltas[-1].finished and not any(o.finished for o in deltas[:-1])
    assert joined(deltas) == whole(cumulative[-1])
    assert all(len(c.token_ids) == 1 for o in deltas for c in o.outputs)  # one new token a step each
    final = {c.index: c.cumulative_logprob for c in cumulative[-1].outputs}
    assert {c.index: c.cumulative_logprob for c in deltas[-1].outputs} == final  # cumulative stays cumulative
    # LLM.generate returns the whole final output whatever the params ask
    for kind in RequestOutputKind:
        (out,) = llm.generate({"prompt_token_ids": prompt}, SamplingParams(**fields, output_kind=kind), use_tqdm=False)
        assert whole(out) == whole(cumulative[-1]) and out.finished


def test_step_final_only_gives_one_output(llm):
    outs = stream(llm.llm_engine, [5, 9, 2, 7], SamplingParams(**SEEDED, n=2, output_kind=FINAL_ONLY))
    assert len(outs) == 1 and outs[0].finished and [len(c.token_ids) for c in outs[0].outputs] == [7, 7]


def test_step_deltas_with_a_stop_string(char_llm):
    engine, prompt = char_llm.llm_engine, "The cat sat on"
    greedy = dict(temperature=0, max_tokens=40, ignore_eos=True)
    free = char_llm.generate(prompt, SamplingParams(**greedy), use_tqdm=False)[0].outputs[0].text
    assert len(free) >= 12, free
    stop = free[8:11]  # three characters: three tokens the stream must hold back before the match
    for include in (False, True):
        params = dict(greedy, stop=[stop], include_stop_str_in_output=include)
        cumulative = stream(engine, prompt, SamplingParams(**params))
        deltas = stream(engine, prompt, SamplingParams(**params, output_kind=DELTA))
        assert joined(deltas) == whole(cumulative[-1])
        c = cumulative[-1].outputs[0]
        assert (c.finish_reason, c.stop_reason) == ("stop", stop)
        assert c.text == free[: free.index(stop) + (len(stop) if include else 0)]
        shown = "".join(o.outputs[0].text for o in deltas)
        assert (stop in shown) is include

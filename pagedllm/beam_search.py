"""Beam search as vLLM runs it: each step asks the engine for one token with 2 * beam_width logprobs per beam,
and keeps the beam_width most likely continuations. Beams share their prompt (and common prefix) blocks through
the prefix cache instead of copying KV."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.outputs import Logprob


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool = False  # stop a prompt's search once beam_width beams have ended with EOS

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} is out of range: an integer >= 1")
        if self.beam_width > 10:
            raise ValueError(f"beam_width={self.beam_width!r} is out of range: at most 10 (2 * beam_width logprobs)")
        if self.temperature != 0.0:
            raise ValueError(f"temperature={self.temperature!r}: beam search is deterministic, only 0 is supported")


@dataclass
class BeamSearchSequence:
    """A beam: all its tokens (prompt first), the logprobs of the generated ones, their sum, and its text."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


def beam_score(seq: BeamSearchSequence, eos_token_id: int | None, length_penalty: float) -> float:
    """vLLM's ranking: cumulative logprob over (length ** length_penalty), the final EOS not counted."""
    length = len(seq.tokens) - (1 if eos_token_id is not None and seq.tokens[-1] == eos_token_id else 0)
    return seq.cum_logprob / (length**length_penalty)


def _extend(beam: BeamSearchSequence, position: dict[int, Logprob], most: int) -> list[BeamSearchSequence]:
    """The beam followed by each of its `most` likeliest next tokens."""
    return [
        BeamSearchSequence(beam.tokens + [tid], beam.logprobs + [position], beam.cum_logprob + lp.logprob)
        for tid, lp in position.items()
        if lp.rank <= most
    ]


def token_logprobs(seq: BeamSearchSequence, prompt_len: int, num_logprobs: int, tokenizer) -> list[dict[int, Logprob]]:
    """A beam's logprobs as a sampled completion reports them: per generated token, that token and the
    `num_logprobs` likeliest (its step must have asked for at least as many), with their text."""
    out = []
    for tid, position in zip(seq.tokens[prompt_len:], seq.logprobs):
        picked = [tid] + [t for t, lp in position.items() if lp.rank <= num_logprobs and t != tid]
        out.append({t: Logprob(position[t].logprob, position[t].rank, _text(tokenizer, t)) for t in picked})
    return out


def _text(tokenizer, token_id: int) -> str | None:
    return tokenizer.decode([token_id]) if tokenizer is not None else None


def run_beam_search(
    llm, prompt_ids: list[list[int]], params: BeamSearchParams, num_logprobs: int = 0, lora_requests=None
) -> list[BeamSearchOutput]:
    """num_logprobs: the top logprobs each step keeps per beam beyond the 2 * beam_width it searches over (for
    token_logprobs). lora_requests: each prompt's LoRARequest (or None), None: the base model for all."""
    from pagedllm.sampling_params import SamplingParams

    engine = llm.llm_engine
    eos = None if params.ignore_eos else engine.eos_token_id
    width = params.beam_width
    step_params = SamplingParams(
        temperature=0.0, max_tokens=1, logprobs=max(2 * width, num_logprobs), ignore_eos=True, detokenize=False
    )
    beams = [[BeamSearchSequence(list(ids))] for ids in prompt_ids]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompt_ids]
    for _ in range(params.max_tokens):
        live = [(i, b) for i, group in enumerate(beams) for b in group]
        if not live:
            break
        lora = {} if lora_requests is None else {"lora_request": [lora_requests[i] for i, _ in live]}
        outs = llm.generate([b.tokens for _, b in live], step_params, use_tqdm=False, **lora)
        candidates: list[list[BeamSearchSequence]] = [[] for _ in prompt_ids]
        for (i, beam), out in zip(live, outs):
            candidates[i].extend(_extend(beam, out.outputs[0].logprobs[0], 2 * width))
        for i, cands in enumerate(candidates):
            cands.sort(key=lambda s: s.cum_logprob, reverse=True)
            kept = cands[:width]
            done[i].extend(s for s in kept if eos is not None and s.tokens[-1] == eos)
            beams[i] = [s for s in kept if eos is None or s.tokens[-1] != eos]
            if params.early_stopping and len(done[i]) >= width:
                beams[i] = []
    tok = llm.get_tokenizer()
    results = []
    for i, ids in enumerate(prompt_ids):
        final = sorted(done[i] + beams[i], key=lambda s: beam_score(s, eos, params.length_penalty), reverse=True)
        for seq in final[:width]:
            seq.finish_reason = "stop" if eos is not None and seq.tokens[-1] == eos else "length"
            if tok is not None:
                seq.text = tok.decode(seq.tokens[len(ids) :], skip_special_tokens=True)
        results.append(BeamSearchOutput(final[:width]))
    return results

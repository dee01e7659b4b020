"""Which running requests get drafts for their next step: the rule that turns speculation off, per step and per row.

1. Batch size: no request gets drafts in a step where more than `disable_by_batch_size` requests decode. Every
   running request whose next step is a decode counts, whether or not it may speculate (as vLLM counts its running
   queue): at large batches the step is compute bound, and verifying drafts costs more than the accepted ones save.
   With async scheduling on, the engine core runs such steps asynchronously (drafts need synchronous steps): while
   the running and waiting requests (up to max_num_seqs) are more than disable_by_batch_size.
2. Per row: a request that may speculate (no bad words or logits processors: Request.can_speculate) keeps a
   running acceptance, an exponential average (weight ACCEPTANCE_WEIGHT) of the fraction of its drafts accepted in
   each step that verified some, starting at 1. When it falls below MIN_ACCEPTANCE the request drafts no more for
   BACKOFF_STEPS of its decode steps, then drafts again for one probe step with its average reset to MIN_ACCEPTANCE:
   a probe that does better than the threshold keeps it drafting, one that does worse backs it off again.

3. Length: with `max_model_len` (vLLM's speculative_max_model_len), a request whose tokens and K drafts would pass it
   gets none.
The proposer (n-gram, draft model) runs only over the requests this leaves; with none left it does not run."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.spec_decode.config import SpeculativeConfig

MIN_ACCEPTANCE = 0.125  # below this fraction of drafts accepted a row stops drafting (see the module's rule 2)
ACCEPTANCE_WEIGHT = 0.25  # weight of the newest step in the running acceptance
BACKOFF_STEPS = 16  # decode steps a row waits without drafts before it probes again


@dataclass
class RowAcceptance:
    rate: float = 1.0  # running acceptance (exponential average of per-step accepted fractions)
    backoff: int = 0  # decode steps left without drafts


class DraftPolicy:
    def __init__(self, config: SpeculativeConfig | None, min_acceptance: float = MIN_ACCEPTANCE) -> None:
        self.disable_by_batch_size = config.disable_by_batch_size if config is not None else None
        self.max_len = config.max_model_len if config is not None else None
        self.k = config.num_speculative_tokens if config is not None else 0
        self.min_acceptance = min_acceptance
        self.rows: dict[str, RowAcceptance] = {}  # request id -> its acceptance (requests still running)
        self.num_backed_off = 0  # times a row was turned off for poor acceptance (for tests and the benchmark)

    def record(self, drafts: dict[str, list[int]], emitted: dict[str, list[int]]) -> None:
        """A step's verification: request id -> the drafts it verified, and -> the tokens it emitted (the accepted
        drafts and one more)."""
        for req_id, proposed in drafts.items():
            tokens = emitted.get(req_id)
            if not proposed or tokens is None:
                continue
            row = self.rows.setdefault(req_id, RowAcceptance())
            accepted = (len(tokens) - 1) / len(proposed)
            row.rate = (1 - ACCEPTANCE_WEIGHT) * row.rate + ACCEPTANCE_WEIGHT * accepted
            if row.rate < self.min_acceptance:
                row.backoff = BACKOFF_STEPS + 1  # select() counts down before it skips
                self.num_backed_off += 1

    def select(self, running: list) -> list:
        """The running requests (engine Request objects) that get drafts for their next step."""
        decoding = [r for r in running if r.num_computed_tokens == r.num_tokens - 1]
        self.rows = {r.request_id: self.rows[r.request_id] for r in running if r.request_id in self.rows}
        if self.disable_by_batch_size is not None and len(decoding) > self.disable_by_batch_size:
            return []
        chosen = []
        for req in decoding:
            if not req.can_speculate or (self.max_len is not None and req.num_tokens + self.k > self.max_len):
                continue
            row = self.rows.get(req.request_id)
            if row is not None and row.backoff:
                row.backoff -= 1
                if row.backoff:
                    continue
                row.rate = self.min_acceptance  # the probe step: its result alone decides
            chosen.append(req)
        return chosen

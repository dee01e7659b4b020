"""The scheduler: one rule, no phases (see docs/ARCHITECTURE.md).

Running requests are served first, then waiting ones, each getting min(tokens left to compute, budget left) tokens.
When blocks run out, the newest running request is preempted (its blocks freed, recomputed later).

A request that samples in a step holds an output placeholder until its token comes back (update_from_output). With
async scheduling the next step is scheduled before that: the placeholder counts as the request's next input (the
runner takes its value on the device), and a request whose placeholder is its last allowed token waits.

A running request may also verify draft tokens (speculative decoding, synchronous scheduling only): they are
scheduled after its known tokens and take budget and KV slots like any; the runner answers with the accepted drafts
and one sampled token, and the rejected drafts' slots are reused (num_computed_tokens rolls back).

A request with a grammar (structured outputs) waits until its grammar is compiled; each step it samples in carries
its allowed-token bitmask, filled from the tokens it has (with k drafts, k + 1 masks: after each draft too). With
async scheduling (`defer_masks`) it is scheduled on its placeholder like any request: its input token is on the
device, only its sampling needs the mask, and the mask needs that token accepted by the grammar. Such a step's masks
are deferred: the engine launches its forward, updates from the previous step, then has them filled (start_masks)
from the grammars as they are now and queues the step's sampling. (Pipeline stages keep a constrained request out of
a step while its last token is on the device.) Drafts come only in synchronous steps, so its masks always follow its
known tokens. Its grammar takes each emitted token, and ends it when it terminates.

With LoRA, at most max_loras distinct adapters are among the running requests (the runner's device slots): a waiting
request of another adapter is passed over, keeping its place, until one of theirs finishes.

A prefill chunk never ends inside an image whose tokens attend to each other both ways (Gemma 3): it stops before the
image, which then waits for a step with budget for all of it (the engine refuses one over max_num_batched_tokens).

With pipeline parallelism (`pipeline_depth` steps in flight, set by the engine core) a request with a step in flight
is not scheduled again (it waits for that step's token), so the batches in flight are disjoint, and a step takes at
most 1 / pipeline_depth of the running requests, so that they split into even batches; a request with a step in
flight is not preempted either, and one that ends meanwhile (an abort) is reported to the runners once its step is
done (its runner row holds that step's sampling until then, and counts toward max_num_seqs). Once the engine has
queued a step's sampling on the device (release_step), its requests count as not in flight for scheduling: they are
scheduled again before their tokens come back, each placeholder the input of its next step, and may be preempted
(the token is then dropped), as with async scheduling."""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.engine.kv_cache_manager import KVCacheManager, cdiv
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.spec_decode.device_drafts import DeviceDrafts
from pagedllm.structured_output.manager import BitmaskFiller, validate_drafts
from pagedllm.worker.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)


@dataclass
class EngineCoreOutput:
    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int
    new_logprobs: list[tuple[list[int], list[float], list[int]]] | None = None  # per new token, when asked for
    prompt_logprobs: tuple[int, list] | None = None  # (first prompt position, entries) computed this step


def keep_items_whole(req: Request, start: int, n: int) -> int:
    """n tokens from `start`, cut back so that the chunk does not end inside an item whose tokens attend to each
    other both ways (Gemma 3's images): it ends before the item, or takes none when it starts inside it."""
    end = start + n
    for f in req.mm_features:
        if f.bidirectional and f.offset < end < f.end:
            return max(f.offset - start, 0)
    return n


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.long_prefill_token_threshold = config.long_prefill_token_threshold  # 0: off
        self.chunked_prefill = config.chunked_prefill
        self.max_loras = config.max_loras  # distinct LoRA adapters among the running requests; None: no limit
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # oldest first: the last one is preempted first
        self.finished_req_ids: set[str] = set()  # since the last schedule(), for the model runner
        self.preempted_req_ids: set[str] = set()
        self.num_preemptions = 0
        # drafts are verified only in synchronous steps (asynchronously, a request's last token may still be on the
        # device when its next step is scheduled); the engine core turns them on where it runs those with drafts
        self.drafts_enabled = not config.async_scheduling
        # slots a decoding request that may speculate gets past its scheduled tokens, for the KV a draft model writes
        # when it proposes after the step (set by the engine core for speculative_config method "draft_model")
        self.num_lookahead_tokens = 0
        self.max_model_len = config.max_model_len
        self.num_drafts = 0  # draft sequences verified so far (one per request and step with drafts)
        self.num_draft_tokens = 0  # drafts verified so far
        self.num_accepted_tokens = 0  # of which accepted
        self.num_accepted_per_pos: list[int] = []  # [position in the draft sequence] drafts accepted there
        self.num_steps = 0
        # step id -> the request objects it scheduled, until its update: a request id used again by a new request
        # while the step was on the device must not take that step's token (the step message holds ids only)
        self.step_reqs: dict[int, dict[str, Request]] = {}
        self.failed: list[EngineCoreOutput] = []  # requests ended before running (a grammar failed to compile)
        self.bitmasks = BitmaskFiller()  # a step's grammar masks, filled while its forward runs
        self.pipeline_depth = 0  # pipeline parallelism: steps in flight on disjoint batches (0: off; see above)
        self.ended_in_flight: dict[str, Request] = {}  # ended while a step of theirs is in flight (pipelined)
        self._busy: set[int] = set()  # id() of the requests with a step in flight, as schedule() began (pipelined)
        self.released: set[int] = set()  # step ids whose sampling is queued: their requests may run again (pipelined)
        # a constrained request is scheduled on its placeholder, the step's masks filled once the previous step's
        # tokens are in (start_masks); the engine core turns it off with pipeline stages
        self.defer_masks = config.async_scheduling

    # -- admission ----------------------------------------------------------------------------------------------
    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """A request whose tokens could never all be cached at once is refused before it enters."""
        needed = cdiv(num_prompt_tokens + max_tokens - 1, self.block_size)
        if needed > self.kv.pool.num_blocks:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) needs {needed} KV-cache blocks "
                f"but the whole cache has {self.kv.pool.num_blocks} blocks of {self.block_size} tokens; "
                "shorten the request or give the cache more memory (kv_cache_memory_bytes)"
            )

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests or request.request_id in self.ended_in_flight:
            raise ValueError(f"request_id={request.request_id!r} is already in use")
        self.check_fits(request.num_prompt_tokens, request.max_tokens)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -----------------------------------------------------------------------------------------------
    def set_drafts(self, drafts: Mapping[str, list[int]]) -> None:
        """Draft tokens proposed for the running requests' next step (the others get none); a constrained request's
        are cut at the first its grammar refuses. Drafts still on the device (DeviceDrafts) are placeholders here,
        but a constrained request's, whose values its grammar checks now."""
        for req in self.running:
            proposed = drafts.get(req.request_id, [])
            if proposed and req.grammar is not None:
                values = drafts.tokens_of(req.request_id) if isinstance(drafts, DeviceDrafts) else proposed
                proposed = validate_drafts(req.grammar, values)
            req.spec_token_ids = proposed

    def _in_flight(self, released: bool = True) -> set[int]:
        """id() of the requests that a step in flight has (a step stays in step_reqs until its update); released:
        counting the released steps."""
        steps = self.step_reqs.items()
        return {id(req) for step, reqs in steps if released or step not in self.released for req in reqs.values()}

    def release_step(self, step_id: int) -> None:
        """The step's sampling is queued on the device (pipelined): its requests may be scheduled again, their
        coming tokens as placeholders."""
        self.released.add(step_id)

    def schedule(self) -> SchedulerOutput:
        self._busy = self._in_flight(released=False) if self.pipeline_depth else set()
        num_scheduled: dict[str, int] = {}
        spec: dict[str, list[int]] = {}
        cached_reqs, budget, preempted = self._schedule_running(num_scheduled, spec)
        new_reqs = [] if preempted else self._schedule_waiting(num_scheduled, budget)
        grammars = {}  # the constrained requests that sample this step
        defer = False  # whether one of them has its last token on the device: the masks wait for it
        for req_id, n in num_scheduled.items():
            req = self.requests[req_id]
            req.num_computed_tokens += n
            num_drafts = len(spec[req_id]) if spec and req_id in spec else 0
            if req.num_computed_tokens - num_drafts == req.num_tokens + req.num_output_placeholders:
                if req.grammar is not None:
                    grammars[req_id] = req.grammar
                    defer = defer or req.num_output_placeholders > 0
                req.num_output_placeholders += 1  # it samples this step (after its drafts are verified)
        out = SchedulerOutput(
            new_reqs,
            cached_reqs,
            num_scheduled,
            sum(num_scheduled.values()),
            self.finished_req_ids,
            self.preempted_req_ids,
            self.num_steps,
            grammar_bitmask=self.bitmasks.submit(grammars, spec, defer),  # with drafts: one mask a verified position
            scheduled_spec_decode_tokens=spec,
        )
        self.step_reqs[self.num_steps] = {req_id: self.requests[req_id] for req_id in num_scheduled}
        self.num_steps += 1
        self.finished_req_ids, self.preempted_req_ids = set(), set()
        return out

    def start_masks(self, so: SchedulerOutput) -> bool:
        """Fills a step's deferred masks (schedule) from its requests' grammars as they are now, once the previous
        step's tokens are in; the requests that ended meanwhile get none. Returns whether they were deferred."""
        masks = so.grammar_bitmask
        if not getattr(masks, "deferred", False):
            return False
        reqs = self.step_reqs.get(so.step_id, {})
        self.bitmasks.start(masks, lambda r: r in reqs and reqs[r].status == RequestStatus.RUNNING)
        return True

    def _schedule_running(
        self, num_scheduled: dict[str, int], spec: dict[str, list[int]]
    ) -> tuple[list[CachedRequestData], int, bool]:
        """Running requests first, oldest first; returns (their data, the budget left, whether one was preempted)."""
        budget = self.max_num_batched_tokens
        cached_reqs: list[CachedRequestData] = []
        preempted = False
        i = 0
        cap = -(-len(self.running) // self.pipeline_depth) if self.pipeline_depth else len(self.running)
        while i < len(self.running) and budget > 0 and len(cached_reqs) < cap:
            req = self.running[i]
            num_known = req.num_tokens + req.num_output_placeholders  # a placeholder is the input of its next step
            if (
                num_known <= req.num_computed_tokens
                or req.num_output_tokens + req.num_output_placeholders >= req.max_tokens
                or (req.grammar is not None and req.num_output_placeholders and not self.defer_masks)
                or id(req) in self._busy  # a step of it is in flight (pipeline parallelism)
            ):  # its last token is still on the device
                i += 1
                continue
            n = self._chunk(req, req.num_computed_tokens, num_known - req.num_computed_tokens, budget)
            if n == 0:  # its next image does not fit in the budget left
                i += 1
                continue
            drafts = self._drafts(req, n, budget) if req.spec_token_ids else ()
            lookahead = self._lookahead(req, n + len(drafts))
            new_blocks = self.kv.allocate_slots(req, n + len(drafts) + lookahead) if lookahead else None
            if new_blocks is None:  # lookahead slots never preempt anything either
                new_blocks = self.kv.allocate_slots(req, n + len(drafts))
            if new_blocks is None and drafts:  # drafts never preempt anything: the request goes on without them
                drafts = []
                new_blocks = self.kv.allocate_slots(req, n)
            while new_blocks is None:
                victim = self._victim()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
                new_blocks = self.kv.allocate_slots(req, n)
            if new_blocks is None:
                break
            cached_reqs.append(
                CachedRequestData(req.request_id, [b.block_id for b in new_blocks], req.num_computed_tokens)
            )
            if drafts:
                spec[req.request_id] = drafts
            num_scheduled[req.request_id] = n + len(drafts)
            budget -= n + len(drafts)
            i += 1
        return cached_reqs, budget, preempted

    def _victim(self) -> Request:
        """The newest running request without a step in flight (there is one: the request being scheduled)."""
        i = len(self.running) - 1
        while id(self.running[i]) in self._busy:
            i -= 1
        return self.running.pop(i)

    def _chunk(self, req: Request, start: int, left: int, budget: int) -> int:
        """Tokens to compute from `start`: the `left` still to compute within the budget (all or none of them
        without chunked prefill), cut to long_prefill_token_threshold (as vLLM) unless that would split an item that
        must stay whole."""
        n = keep_items_whole(req, start, min(left, budget))
        if not self.chunked_prefill and n < left:  # the prompt waits for a step with budget for all of it
            return 0
        if 0 < self.long_prefill_token_threshold < n:
            n = keep_items_whole(req, start, self.long_prefill_token_threshold) or n
        return n

    def _drafts(self, req: Request, n: int, budget: int) -> list[int]:
        """The drafts the request verifies this step (taking them from it): only when its n tokens reach the end of
        its known tokens, within the budget left and with room for one more token before max_tokens. With async
        scheduling there are none (the request's last token may still be on the device)."""
        drafts, req.spec_token_ids = req.spec_token_ids, []
        if not self.drafts_enabled or req.num_computed_tokens + n < req.num_tokens:
            return []
        room = min(budget - n, req.max_tokens - req.num_output_tokens - 1)
        return drafts[: max(room, 0)]

    def _lookahead(self, req: Request, num_new: int) -> int:
        """Slots for the draft model's writes after the step (up to num_lookahead_tokens past the scheduled tokens,
        within max_model_len), for a request that may speculate and reaches the end of its known tokens."""
        end = req.num_computed_tokens + num_new
        if (
            not self.num_lookahead_tokens
            or end < req.num_tokens
            or not req.can_speculate
            or req.num_output_placeholders
        ):
            return 0
        return max(0, min(self.num_lookahead_tokens, self.max_model_len - end))

    def _schedule_waiting(self, num_scheduled: dict[str, int], budget: int) -> list[NewRequestData]:
        """Waiting requests in order while the budget, max_num_seqs and the free blocks allow."""
        new_reqs: list[NewRequestData] = []
        # passed over (they keep their place): until their grammar is compiled, or their adapter gets a slot
        passed: list[Request] = []
        loras = {r.lora_int_id for r in self.running if r.lora_int_id} if self.max_loras else set()
        while self.waiting and budget > 0 and len(self.running) + len(self.ended_in_flight) < self.max_num_seqs:
            req = self.waiting[0]
            if req.grammar is not None and not req.grammar.ready():
                passed.append(self.waiting.popleft())
                continue
            if self.max_loras and req.lora_int_id and req.lora_int_id not in loras and len(loras) >= self.max_loras:
                passed.append(self.waiting.popleft())  # max_loras other adapters are running
                continue
            if req.grammar is not None and req.grammar.error() is not None:
                self._fail(self.waiting.popleft(), req.grammar.error())
                continue
            computed_blocks, num_hit = self.kv.get_computed_blocks(req)
            n = self._chunk(req, num_hit, req.num_tokens - num_hit, budget)
            if n == 0 or self.kv.allocate_slots(req, n, computed_blocks) is None:
                break
            self.waiting.popleft()
            self.kv.record_lookup(req, num_hit)
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
                req.first_scheduled_time = time.monotonic()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.lora_int_id:
                loras.add(req.lora_int_id)
            new_reqs.append(
                NewRequestData(
                    req.request_id,
                    list(req.all_token_ids),
                    req.num_prompt_tokens,
                    req.sampling_params.without_callables(),  # plain data (the callables stay in the engine)
                    self.kv.block_ids(req.request_id),
                    num_hit,
                    req.min_tokens_stop_ids(),
                    req.lora_request,
                    req.mm_features,
                    bool(req.sampling_params.logits_processors),
                    req.prompt_embeds,
                )
            )
            num_scheduled[req.request_id] = n
            budget -= n
        self.waiting.extendleft(reversed(passed))
        return new_reqs

    def wait_for_grammars(self, timeout: float) -> None:
        """Blocks up to timeout until a waiting request's grammar is compiled: for a step that found nothing else
        to run (the engine would spin otherwise)."""
        pending = [r.grammar.compiled for r in self.waiting if r.grammar is not None and not r.grammar.ready()]
        if pending:
            concurrent.futures.wait(pending, timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def _fail(self, req: Request, error: BaseException) -> None:
        """Ends a request that cannot run (its grammar did not compile); it is reported at the next update."""
        logger.warning("request %s: its grammar failed to compile: %s", req.request_id, error)
        req.status = RequestStatus.FINISHED_ABORTED
        self.requests.pop(req.request_id, None)
        self.finished_req_ids.add(req.request_id)
        self.failed.append(EngineCoreOutput(req.request_id, [], "abort", None, 0))

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_output_placeholders = 0  # a token still on the device is dropped; it is sampled again later
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        self.preempted_req_ids.add(req.request_id)

    def update_from_output(self, so: SchedulerOutput, out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs, self.failed = self.failed, []
        scheduled = self.step_reqs.pop(so.step_id, {})
        self.released.discard(so.step_id)
        if self.ended_in_flight:
            self._release_ended()
        spec = so.scheduled_spec_decode_tokens
        for req_id in dict.fromkeys([*out.sampled_token_ids, *out.prompt_logprobs]):
            req = self.requests.get(req_id)
            if req is None or req.status != RequestStatus.RUNNING or scheduled.get(req_id, req) is not req:
                continue
            tokens = out.sampled_token_ids.get(req_id)
            if tokens is None:
                new_tokens = []
            else:
                new_tokens = self._accept(req, tokens, len(spec[req_id]) if spec and req_id in spec else 0)
            logprobs = out.logprobs.get(req_id)
            outputs.append(
                EngineCoreOutput(
                    req_id,
                    new_tokens,
                    req.status.finish_reason,
                    req.stop_reason,
                    max(req.num_cached_tokens, 0),
                    logprobs[: len(new_tokens)] if logprobs is not None else None,
                    out.prompt_logprobs.get(req_id),
                )
            )
        return outputs

    def _accept(self, req: Request, tokens: list[int], num_drafts: int) -> list[int]:
        """Takes a request's step result: its accepted drafts and one sampled token. The slots of rejected drafts
        are written again later (num_computed_tokens rolls back to the accepted length). Returns the tokens kept
        (cut after one that ends the request)."""
        if not 1 <= len(tokens) <= num_drafts + 1:
            raise RuntimeError(f"request {req.request_id!r}: {len(tokens)} tokens for {num_drafts} drafts")
        req.num_output_placeholders -= 1
        if num_drafts == 0:  # one token (the usual step)
            req.append_output_token(tokens[0])
            tokens = self._advance_grammar(req, tokens)
            if req.status.finished or req.check_stop() or self._grammar_terminated(req):
                self._remove(req)
            return tokens
        kept = self._advance_grammar(req, req.append_output_tokens(tokens))
        self._count_drafts(num_drafts, len(tokens) - 1)
        req.num_computed_tokens -= num_drafts + 1 - len(tokens)
        self.kv.cache_blocks(req, req.num_computed_tokens)  # blocks now full of accepted, computed tokens
        if req.status.finished or self._grammar_terminated(req):
            self._remove(req)
        return kept

    def _advance_grammar(self, req: Request, tokens: list[int]) -> list[int]:
        """The request's grammar takes its new tokens (already appended); returns those kept. A refused token (a
        rule that overrode the mask, such as min_tokens banning the EOS that alone was allowed) and those after it
        are dropped, and end the request: stopped where the grammar was complete, else aborted."""
        grammar = req.grammar
        if grammar is None:
            return tokens
        num_kept = grammar.accept(tokens)
        if num_kept < len(tokens):
            del req.all_token_ids[len(req.all_token_ids) - len(tokens) + num_kept :]
            complete = grammar.is_completed()
            if not complete:
                logger.warning("request %s: its grammar refused a sampled token; it is aborted", req.request_id)
            req.status = RequestStatus.FINISHED_STOPPED if complete else RequestStatus.FINISHED_ABORTED
        return tokens[:num_kept]

    def _grammar_terminated(self, req: Request) -> bool:
        """Ends a request whose grammar has terminated (it took a stop token that did not stop it: ignore_eos)."""
        if req.grammar is None or not req.grammar.is_terminated():
            return False
        req.status = RequestStatus.FINISHED_STOPPED
        return True

    def _count_drafts(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.num_accepted_per_pos) < num_drafts:
            self.num_accepted_per_pos += [0] * (num_drafts - len(self.num_accepted_per_pos))
        for pos in range(num_accepted):  # drafts are accepted from the first on: positions 0 .. num_accepted - 1
            self.num_accepted_per_pos[pos] += 1

    # -- leaving ------------------------------------------------------------------------------------------------
    def _remove(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)  # (a step in flight writes its blocks before any later step on each stage reads them)
        self.requests.pop(req.request_id, None)
        if self.pipeline_depth and id(req) in self._in_flight():
            self.ended_in_flight[req.request_id] = req
        else:
            self.finished_req_ids.add(req.request_id)

    def _release_ended(self) -> None:
        """Requests that ended with a step in flight reach the runners once no step of theirs is."""
        busy = self._in_flight()
        for req_id, req in list(self.ended_in_flight.items()):
            if id(req) not in busy:
                del self.ended_in_flight[req_id]
                self.finished_req_ids.add(req_id)

    def discard_requests(self, req_ids: list[str]) -> None:
        """Aborts requests whose last step failed, forgetting the prefix-cache hashes of their blocks."""
        for req_id in req_ids:
            if req_id in self.requests:
                self.kv.uncache(self.requests[req_id])
        self.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, req_ids: list[str], status: RequestStatus) -> None:
        """Ends requests from outside the step (abort, or a stop string found by the output processor)."""
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is None or req.status.finished:
                continue
            req.status = status
            self._remove(req)

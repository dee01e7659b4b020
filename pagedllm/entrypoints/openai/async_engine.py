"""AsyncEngine: an LLM driven by one dedicated thread, for an asyncio server.

Everything that changes the engine runs on that thread (`call`), between engine steps, so the engine is never
changed from two threads at once and the event loop never blocks on a forward pass. What a request costs before it
enters (tokenizing, rendering the chat template, checking it, encoding its bad words) runs in a small pool of
preparation threads (`prepare`), so an expensive or refused request delays only itself, not the running ones.

While any request is unfinished the thread runs `LLMEngine.step()` and hands each request's output to its
RequestStream; a stream keeps only the newest output per request (outputs are cumulative; a request whose
output_kind is DELTA, as AsyncLLMEngine's callers may ask, gets the deltas a slow reader has not taken merged into
one), so a slow client costs no growth beyond its request's text. Closing a stream before its requests finish
aborts them, freeing their blocks."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from queue import SimpleQueue
from typing import Any

from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

PromptsFn = Callable[[], list[tuple[str | None, list[int]]]]
CheckFn = Callable[[list[tuple[str | None, list[int]]]], None]
NUM_PREPARE_THREADS = 4  # requests prepared at once; more wait their turn without holding the engine thread


class EngineDeadError(RuntimeError):
    """The engine step failed; the requests running in it were ended."""


class RequestStream:
    """Outputs of the requests of one API call (one per prompt), as (prompt index, RequestOutput): cumulative, or
    with delta=True the deltas since the last one read (several merged when the reader is slower than the engine)."""

    def __init__(self, engine: AsyncEngine, request_ids: list[str], delta: bool = False) -> None:
        self.engine = engine
        self.delta = delta
        self.loop = asyncio.get_running_loop()
        self.index = {rid: i for i, rid in enumerate(request_ids)}
        self.unfinished = set(request_ids)
        self.latest: dict[str, RequestOutput | BaseException] = {}
        self.ready = asyncio.Event()

    def deliver(self, output: RequestOutput | BaseException, request_id: str) -> None:
        """Called from the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self._put, request_id, output)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _put(self, request_id: str, output: RequestOutput | BaseException) -> None:
        unread = self.latest.get(request_id)
        if self.delta and isinstance(unread, RequestOutput) and isinstance(output, RequestOutput):
            unread.add(output, aggregate=True)  # not yet read: no delta may be lost
        else:
            self.latest[request_id] = output
        self.ready.set()

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self.unfinished:
            await self.ready.wait()
            self.ready.clear()
            batch, self.latest = self.latest, {}
            for rid, out in batch.items():
                if isinstance(out, BaseException):
                    self.unfinished.clear()
                    raise EngineDeadError(f"the engine failed while running this request: {out}") from out
                if out.finished:
                    self.unfinished.discard(rid)
                yield self.index[rid], out

    def close(self) -> None:
        """Aborts the requests that have not finished (a client went away, or the handler failed)."""
        if self.unfinished:
            self.engine.abort(list(self.unfinished))
            self.unfinished.clear()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()


class DaemonThreads:
    """A few daemon threads running submitted calls. Unlike ThreadPoolExecutor's threads, they never hold up the
    process's exit: a request still being prepared when the server stops (a huge one, say) does not delay it."""

    def __init__(self, num_threads: int, name: str) -> None:
        self._queue: SimpleQueue = SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(num_threads)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self, timeout: float = 1.0) -> None:
        """Ends the idle threads and waits briefly for them (one still preparing a request is left to finish): a
        thread that exits while the interpreter finalizes can abort the process."""
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # handed to the awaiting request
                future.set_exception(e)


class AsyncEngine:
    def __init__(self, llm) -> None:
        self.llm = llm
        self.engine = llm.llm_engine
        self.generates = hasattr(self.engine, "step")  # False for a pooling model
        self._cond = threading.Condition()
        self._calls: list[Callable[[], None]] = []
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._running = False
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._pool = DaemonThreads(NUM_PREPARE_THREADS, "pagedllm-prepare")
        self.request_logger = None  # server_logging.RequestLogger, or None (--disable-log-requests)

    # -- lifecycle (event-loop side) ----------------------------------------------------------------------------
    def start(self) -> None:
        self._running = True
        self._thread.start()
        self._pool.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Aborts whatever still runs and ends the engine thread."""
        with self._cond:
            self._running = False
            self._cond.notify()
        self._thread.join(timeout)
        self._pool.stop()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- requests (event-loop side) -----------------------------------------------------------------------------
    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs fn on the engine thread, between steps; returns its result or raises its exception."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def run() -> None:
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:  # handed to the caller, who turns user errors into HTTP 400
                loop.call_soon_threadsafe(_settle, future, None, e)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

        self._submit(run)
        return await future

    async def prepare(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs fn in a preparation thread (work that reads the tokenizer or the config, never changes the engine)."""
        return await asyncio.wrap_future(self._pool.submit(fn, *args))

    async def run_in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Runs fn in a daemon thread of its own (long work, such as a beam search driving the engine)."""
        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(fn(*args))
            except BaseException as e:
                future.set_exception(e)

        threading.Thread(target=run, name="pagedllm-work", daemon=True).start()
        return await asyncio.wrap_future(future)

    async def generate(
        self,
        make_prompts: PromptsFn,
        num_prompts: int,
        params: SamplingParams,
        request_id: str,
        check: CheckFn | None = None,
        cache_salt: str | None = None,
        lora_request=None,
    ) -> RequestStream:
        """Adds the prompts as requests `{request_id}-{i}` and returns their stream. `make_prompts()` (it may
        tokenize), `check(prompts)` and the engine's checks of every prompt (ValueError) run in a preparation
        thread, before any prompt enters the engine; only the admission itself runs on the engine thread."""
        ids = [f"{request_id}-{i}" for i in range(num_prompts)]
        engine = self.engine

        def make_requests() -> list:
            prompts = make_prompts()
            if check is not None:
                check(prompts)
            for rid, (text, tokens) in zip(ids, prompts) if self.request_logger is not None else ():
                self.request_logger.received(rid, text, tokens, params)
            lora = {"lora_request": lora_request} if lora_request is not None else {}
            return [  # a pair may carry its processed images (multimodal.inputs.ProcessedPair)
                engine.make_request(
                    prompt[0],
                    prompt[1],
                    params,
                    rid,
                    cache_salt=cache_salt,
                    mm_features=getattr(prompt, "mm_features", None),
                    prompt_embeds=getattr(prompt, "prompt_embeds", None),  # (serving_embeds.EmbedsPair)
                    **lora,
                )
                for rid, prompt in zip(ids, prompts)
            ]

        pending = await self.prepare(make_requests)
        stream = RequestStream(self, ids, params.output_kind == RequestOutputKind.DELTA)

        def add() -> None:
            for rid, (requests, state) in zip(ids, pending):
                engine.add(requests, state)
                self._streams[rid] = stream

        try:
            await self.call(add)
        except asyncio.CancelledError:
            stream.close()  # queued after add(), so whatever it added is aborted
            raise
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Thread-safe; the abort happens on the engine thread before its next step."""
        self._submit(lambda: self._abort(request_ids))

    # -- engine thread ------------------------------------------------------------------------------------------
    def _submit(self, fn: Callable[[], None]) -> None:
        with self._cond:
            self._calls.append(fn)
            self._cond.notify()

    def _busy(self) -> bool:
        return self.generates and self.engine.has_unfinished_requests()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._running and not self._calls and not self._busy():
                    self._cond.wait()
                calls, self._calls = self._calls, []
                running = self._running
            for fn in calls:
                fn()
            if not running:
                self._abort(list(self._streams))
                return
            if self._busy():
                self._step()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # a failed forward ends the requests in flight, not the server
            logger.exception("engine step failed")
            streams = dict(self._streams)
            self._abort(list(streams))
            for rid, stream in streams.items():
                stream.deliver(e, rid)
            return
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.deliver(out, out.request_id)
            if out.finished:
                del self._streams[out.request_id]
                if self.request_logger is not None:
                    self.request_logger.finished(out.request_id)

    def _abort(self, request_ids: list[str]) -> None:
        ids = [rid for rid in request_ids if self._streams.pop(rid, None) is not None]
        if ids and self.generates:
            self.engine.abort_request(ids)
            if self.request_logger is not None:
                self.request_logger.aborted(ids)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)

"""The worker each rank runs: its device, its process groups and its ModelRunner, driven by the executor's calls.

Rank 0 lives in the engine's process (the executor calls it directly); the other ranks run `serve` in a process of
their own (python -m pagedllm.distributed.worker), reading calls from a local socket: plain data (the engine config,
scheduler outputs), pickled over a socket pair that only the two processes hold, never over a network port."""

from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from pagedllm.config import EngineConfig
from pagedllm.distributed.parallel_state import ParallelGroups, RankInfo
from pagedllm.profiler import EngineProfiler
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.pooling_runner import PoolingRequest, PoolingRunner
from pagedllm.worker.scheduler_output import SchedulerOutput

# a collective waiting this much longer on NCCL than on gloo: a GPU rank's first steps compile kernels and capture
# graphs, and a dead GPU worker is found by the executor's monitor, not by the timeout
_NCCL_MIN_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to start: its place among the ranks and where the rendezvous store listens."""

    info: RankInfo
    store_host: str
    store_port: int
    local_device: int  # the CUDA device index on its machine (ignored on CPU)
    timeout_s: float
    num_threads: int  # torch CPU threads (0: leave torch's default)


class Worker:
    def __init__(self, config: EngineConfig, spec: WorkerSpec, store: dist.Store | None = None) -> None:
        device = config.device.device
        if device.type == "cuda":
            device = torch.device("cuda", spec.local_device)
            torch.cuda.set_device(device)
            config = replace(config, device=replace(config.device, device=device))
        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        warm_cpu_kernels(device)
        timeout = spec.timeout_s if device.type != "cuda" else max(spec.timeout_s, _NCCL_MIN_TIMEOUT_S)
        self.info = spec.info
        custom = not config.parallel.disable_custom_all_reduce
        try:
            if store is None:
                wait = datetime.timedelta(seconds=timeout)
                store = dist.TCPStore(spec.store_host, spec.store_port, spec.info.world_size, False, timeout=wait)
            self.groups = ParallelGroups.create(store, spec.info, device, timeout, custom)
        except Exception as e:
            backend = "NCCL" if device.type == "cuda" else "gloo"
            raise RuntimeError(
                f"rank {spec.info.rank} could not join the {backend} groups at {spec.store_host}:{spec.store_port} "
                f"({type(e).__name__}: {e})"
            ) from e
        # groups left at interpreter exit are shut down first (an NCCL group torn down with the interpreter aborts it)
        self._end_groups = weakref.finalize(self, self.groups.shutdown)
        # a pooling model's ranks run whole sequences (worker/pooling_runner.py): no KV cache, no steps
        pooling = config.model.runner == "pooling"
        self.runner = PoolingRunner(config, self.groups) if pooling else ModelRunner(config, self.groups)
        self.pending = None  # the launched step whose tokens this rank has not put in its batch yet
        self.unfinished: deque = deque()  # pipeline stages, first-stage followers: steps launched, not finished
        self.profiler: EngineProfiler | None = None  # LLM.start_profile's, on this rank (profiler.RanksProfiler)

    def kv_bytes_per_block(self) -> int:
        return self.runner.kv_bytes_per_block()

    def available_kv_cache_bytes(self) -> int | None:
        return self.runner.available_kv_cache_bytes()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)
        self.runner.capture_cudagraphs()

    def launch(self, so: SchedulerOutput):
        """A step on this rank. A follower keeps one step in flight as the engine does: the previous step's tokens
        enter its batch after this one is queued; around a step with drafts they enter before (its inputs are read
        on the host, and after it only the accepted tokens count). With pipeline stages, a first-stage follower
        keeps its launched steps until the engine has it sample them (finish), in the driver's order; a sampled
        step's tokens enter its batch after the next launch (whose inputs may take them on the device)."""
        if self.info.pp_size > 1:
            future = self.runner.launch(so)
            if self.info.pp_rank == 0 and not self.info.is_driver:
                self.unfinished.append(future)
                self.commit_pending()
            return future
        if so.scheduled_spec_decode_tokens or getattr(self.pending, "drafts", None) is not None:
            self.commit_pending()
        future = self.runner.launch(so)
        if not self.info.is_driver:
            self.commit_pending()
            self.pending = future
        return future

    def propose(self, req_ids: list[str]) -> None:
        """A follower's part of a proposal: the driver's drafts for these requests, received after this rank's last
        step (whose collectives come first), kept for the verify step (spec_decode/shared_drafts.py)."""
        self.commit_pending()
        self.runner.drafter.propose(dict.fromkeys(req_ids))

    def pool(self, reqs: list[PoolingRequest]):
        """A pooling model's batch on this rank (PoolingRunner.execute): its results as numpy arrays (plain data for
        the socket: torch's own pickling of a tensor would hand over shared memory), or None on the ranks that do
        not return them."""
        out = self.runner.execute(reqs)
        return None if out is None else [t.numpy() for t in out]

    def apply(self, fn, *args):
        """fn(runner, *args) on this rank's runner, its result (a tool or test adjusting or reading every rank)."""
        return fn(self.runner, *args)

    def finish(self) -> None:
        """A first-stage follower with pipeline stages: the oldest launched step's logits (gathered with the driver's)
        and sampled tokens, queued as the driver samples that step; committed after the next launch."""
        self.commit_pending()
        self.pending = self.unfinished.popleft()
        self.pending.sample()

    def commit_pending(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None

    def start_profile(self, trace_dir: str) -> None:
        """This rank's part of LLM.start_profile: its own trace, named by its rank."""
        self.profiler = EngineProfiler(trace_dir, f"pagedllm-rank{self.info.rank}")
        self.profiler.start()

    def stop_profile(self) -> None:
        self.profiler.stop()
        self.profiler = None

    def shutdown(self) -> None:
        self._end_groups()


def warm_cpu_kernels(device: torch.device) -> None:
    """Builds (or loads) the C kernels before the first collective, so no rank waits on another's compiler."""
    if device.type == "cpu":
        from pagedllm.kernels import cpu_kernels

        cpu_kernels.compiled()


def die_with_parent() -> None:
    """Ends this process within a second of the engine's process dying, however it dies (the main thread may be
    waiting in a collective that will never complete)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="pagedllm-parent-watch", daemon=True).start()


def serve(conn: Connection) -> None:
    """A follower's loop: the first message builds the worker (answered twice: once started, so that the ranks
    meet in the groups' rendezvous at about the same time, once built); then each message is (method, args);
    "launch", "finish" and "propose" get no answer, the others get ("ok", result) or ("error", traceback). Ends when
    the engine hangs up."""
    try:
        config, spec = conn.recv()
        warm_cpu_kernels(config.device.device)
        conn.send(("ok", None))
        worker = Worker(config, spec)
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):
            break
        if method == "shutdown":
            break
        try:
            result = getattr(worker, method)(*args)
            if method not in ("launch", "finish", "propose"):
                conn.send(("ok", result))
        except BaseException:
            conn.send(("error", f"rank {spec.info.rank}: {traceback.format_exc()}"))
            os._exit(1)
    worker.shutdown()


def main() -> None:
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the engine, which ends its workers
    conn = Connection(int(sys.argv[1]))
    try:
        serve(conn)
    finally:
        conn.close()
        os._exit(0)  # skip interpreter teardown: a process group may still hold threads


if __name__ == "__main__":
    main()

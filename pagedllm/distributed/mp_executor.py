"""The multiprocess executor: rank 0 in the engine's process, ranks 1.. in worker processes on this machine.

Each worker is a fresh interpreter (python -m pagedllm.distributed.worker: spawned, never forked, so no CUDA state
is inherited and a user script without a main guard is not re-run), bound to its GPU by index among the visible
ones (CUDA_VISIBLE_DEVICES is honoured). The engine sends each step's scheduler output to every worker over a
socket pair, then runs its own rank; the ranks meet in the collectives. With pipeline stages a step's result is
sampled on the first stage when the engine asks (sample()): its future then tells the driver's first-stage peers
to sample that step too (distributed/pipeline.py). A monitor thread per worker notices one that exits: the engine's
next call raises an error naming it, and the other workers are ended."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import replace

import torch
import torch.distributed as dist

from pagedllm.config import EngineConfig
from pagedllm.distributed.parallel_state import RankInfo
from pagedllm.distributed.worker import Worker, WorkerSpec
from pagedllm.worker.cpu_threads import worker_threads
from pagedllm.worker.scheduler_output import ModelRunnerOutput, SchedulerOutput

_SHUTDOWN_WAIT_S = 5.0
_FINISH = pickle.dumps(("finish", ()), protocol=pickle.HIGHEST_PROTOCOL)


class WorkerFailed(RuntimeError):
    """A worker process died, hung past the collectives' timeout or raised."""


class RanksExecutor:
    """What the executors of several ranks share: rank 0 (`driver`, a Worker in this process) and the others reached
    through `_call(method, *args)` (-> [driver's answer, the others'...]); subclasses add `launch` and `shutdown`."""

    driver: Worker

    def _call(self, method: str, *args) -> list:
        raise NotImplementedError

    def launch(self, scheduler_output: SchedulerOutput):
        raise NotImplementedError

    @property
    def runner(self):
        """The driver rank's ModelRunner (rank 0, in this process)."""
        return self.driver.runner

    def kv_bytes_per_block(self) -> int:
        return max(self._call("kv_bytes_per_block"))

    def available_kv_cache_bytes(self) -> int | None:
        found = self._call("available_kv_cache_bytes")
        return None if found[0] is None else min(found)

    def register_logits_processors(self, req_id: str, processors: list) -> None:
        self.driver.runner.register_logits_processors(req_id, processors)

    def add_lora(self, lora_request) -> bool:
        """Reads and checks a LoRA adapter on the driver (ValueError); the other ranks read their parts when a
        request with it reaches them. False if it was known."""
        return self.driver.runner.add_lora(lora_request)

    def propose(self, token_ids: dict[str, list[int]]):
        """Drafts from the driver's draft model; its first-stage peers take them in a broadcast after the request ids
        reach them (spec_decode/shared_drafts.py)."""
        self._post("propose", list(token_ids))
        return self.driver.runner.drafter.propose(token_ids)

    def _post(self, method: str, *args) -> None:
        """Calls `method` on every other rank without an answer."""
        raise NotImplementedError

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._call("initialize_kv_cache", num_blocks)

    def pool(self, reqs: list) -> list:
        """A pooling model's batch on every rank (PoolingRunner.execute); the results of the last stage's first
        rank (global rank (pp_size - 1) * tp_size), which alone returns them."""
        info = self.driver.info
        return [torch.from_numpy(x) for x in self._call("pool", reqs)[(info.pp_size - 1) * info.tp_size]]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.launch(scheduler_output).result()


class MultiprocExecutor(RanksExecutor):
    def __init__(self, config: EngineConfig) -> None:
        p = config.parallel
        world = p.tensor_parallel_size * p.pipeline_parallel_size
        on_cuda = config.device.device.type == "cuda"
        if on_cuda and torch.cuda.device_count() < world:
            raise ValueError(
                f"tensor_parallel_size * pipeline_parallel_size = {world} GPUs, but this machine shows "
                f"{torch.cuda.device_count()} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
                "use distributed_executor_backend='ray' to span machines"
            )
        threads = worker_threads(on_cuda, world)
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
        self.failure: str | None = None
        self.closing = False
        self.procs: list[subprocess.Popen] = []
        self.conns: list[multiprocessing.connection.Connection] = []
        self._finalizer = weakref.finalize(self, _end_workers, self.procs, self.conns)
        # the logits processor classes run on the driver: a follower gets their names (classes may not pickle)
        names = tuple(cls.__qualname__ for cls in config.logits_processors)
        follower_config = replace(config, speculative_proposer=None, logits_processors=names)
        base = dict(store_host="127.0.0.1", store_port=store.port, timeout_s=p.distributed_timeout_s)
        for rank in range(1, world):
            spec = WorkerSpec(RankInfo(rank, p.tensor_parallel_size, p.pipeline_parallel_size), **base,
                              local_device=rank, num_threads=threads)  # fmt: skip
            self._spawn(follower_config, spec)
        if threads:
            torch.set_num_threads(threads)
        spec0 = WorkerSpec(RankInfo(0, p.tensor_parallel_size, p.pipeline_parallel_size), **base,
                           local_device=config.device.device.index or 0, num_threads=threads)  # fmt: skip
        try:
            self._answers()  # every worker started (the groups' rendezvous waits for the slowest)
            self.driver = Worker(config, spec0, store)
            self._answers()  # every worker built its model
        except BaseException as e:
            self.shutdown()
            raise self._error(e) from e
        for rank, proc in enumerate(self.procs, start=1):
            threading.Thread(target=self._monitor, args=(rank, proc), daemon=True, name=f"pagedllm-rank{rank}").start()

    def _spawn(self, config: EngineConfig, spec: WorkerSpec) -> None:
        ours, theirs = multiprocessing.Pipe()
        fd = theirs.fileno()
        proc = subprocess.Popen([sys.executable, "-m", "pagedllm.distributed.worker", str(fd)], pass_fds=[fd])
        theirs.close()
        self.procs.append(proc)
        self.conns.append(ours)
        try:
            ours.send((config, spec))
        except OSError:  # the worker is gone already (a broken pipe); _answers() reports how it ended
            pass

    def _monitor(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if self.closing or self.failure is not None:
            return
        self.failure = f"worker rank {rank} (pid {proc.pid}) exited with code {code}"
        self._abort()

    def _abort(self) -> None:
        """Ends every worker and aborts this rank's groups, so that no collective waits for a dead peer."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        groups = self.driver.groups if hasattr(self, "driver") else None
        comms = (groups.tp, groups.pp, groups.pp_back, groups.world) if groups is not None else ()
        for comm in {id(c): c for c in comms}.values():
            abort = getattr(comm.pg, "abort", None)
            if abort is not None and comm.device.type == "cuda":  # (in a thread of its own: it may block)
                threading.Thread(target=abort, daemon=True, name="pagedllm-nccl-abort").start()

    def _answers(self) -> list:
        """Each worker's answer to the last call, in rank order (an error answer or a dead worker raises)."""
        results = []
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs), start=1):
            try:
                while not conn.poll(0.05):
                    if proc.poll() is not None and not conn.poll():
                        raise EOFError
                status, value = conn.recv()
            except (EOFError, OSError):  # the worker is gone, its last answer read
                try:
                    code = proc.wait(_SHUTDOWN_WAIT_S)
                except subprocess.TimeoutExpired:
                    code = None
                raise WorkerFailed(f"worker rank {rank} (pid {proc.pid}) exited with code {code}") from None
            if status != "ok":
                raise WorkerFailed(value)
            results.append(value)
        return results

    def _error(self, error: BaseException) -> BaseException:
        """The error to raise for `error`: with the worker's own traceback where one sent it."""
        if isinstance(error, WorkerFailed):
            return error
        detail = self.failure
        for conn in self.conns:
            try:
                if conn.poll():
                    status, value = conn.recv()
                    if status == "error":
                        detail = value
            except (EOFError, OSError):
                continue
        if detail is None and not isinstance(error, (RuntimeError, dist.DistBackendError)):
            return error
        self.failure = self.failure or detail or str(error)
        self._abort()
        return WorkerFailed(f"a tensor/pipeline-parallel worker failed: {detail or error}")

    def _call(self, method: str, *args):
        """Calls `method` on every rank (the workers' answers and the driver's); returns [driver's, workers'...]."""
        self._post(method, *args)
        try:
            mine = getattr(self.driver, method)(*args)
            return [mine, *self._answers()]
        except BaseException as e:
            raise self._error(e) from e

    def _check(self) -> None:
        if self.failure is not None:
            raise WorkerFailed(f"a tensor/pipeline-parallel worker failed: {self.failure}")

    def _post(self, method: str, *args) -> None:
        self._check()
        message = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self.conns:
                conn.send_bytes(message)
        except BaseException as e:
            raise self._error(e) from e

    def launch(self, scheduler_output: SchedulerOutput) -> GuardedFuture:
        self._post("launch", replace(scheduler_output, grammar_bitmask={}))  # the driver alone samples
        try:
            return GuardedFuture(self.driver.launch(scheduler_output), self, self._finishers())
        except BaseException as e:
            raise self._error(e) from e

    def _finishers(self) -> list:
        """The connections of the driver's first-stage peers with pipeline stages (they finish each step with it)."""
        info = self.driver.info
        return self.conns[: info.tp_size - 1] if info.pp_size > 1 else []

    def shutdown(self) -> None:
        """Ends the workers, then this rank's groups."""
        self.closing = True
        self._finalizer()
        if hasattr(self, "driver"):
            self.driver.shutdown()


class GuardedFuture:
    """A step's future that stops waiting, with the worker's error, when a worker fails meanwhile."""

    def __init__(self, future, executor: MultiprocExecutor, finishers: list = ()) -> None:
        self.future, self.executor, self.finishers = future, executor, finishers

    def sample(self) -> None:
        """A pipelined step's sampling queued on the device (distributed/pipeline.py); the driver's first-stage
        peers sample it with the driver."""
        try:
            for conn in self.finishers:
                conn.send_bytes(_FINISH)
            self.finishers = ()
            self.future.sample()
        except BaseException as e:
            raise self.executor._error(e) from e

    def result(self) -> ModelRunnerOutput:
        self.sample()
        while not self.future.done():  # the device waits on a collective a dead peer will never join
            if self.executor.failure is not None:
                self.executor._check()
            time.sleep(0)
        try:
            return self.future.result()
        except BaseException as e:
            raise self.executor._error(e) from e


def _end_workers(procs: list[subprocess.Popen], conns: list) -> None:
    """Asks the workers to stop, then kills those still running after a few seconds (also at interpreter exit)."""
    for conn in conns:
        try:
            conn.send(("shutdown", ()))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + _SHUTDOWN_WAIT_S
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for conn in conns:
        conn.close()

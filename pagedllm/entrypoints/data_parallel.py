"""Data parallelism for offline jobs: `LLM(data_parallel_size=D)` runs D engine replicas, each a whole `LLM` with
data_parallel_size=1. Replica 0 is the LLM in the caller's process; the others live in worker processes on this
machine (python -m pagedllm.entrypoints.data_parallel: spawned, never forked), or in Ray actors with
distributed_executor_backend="ray". On GPUs replica i takes the visible GPUs [i * W, (i + 1) * W), W =
tensor_parallel_size * pipeline_parallel_size, through its CUDA_VISIBLE_DEVICES.

A call (generate, chat, encode, embed, classify) splits its prompts into D contiguous chunks, one per replica;
the replicas run at once and the results come back in input order. Per-prompt arguments (a list as long as the
prompts, e.g. one SamplingParams per prompt) are split the same way."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import traceback
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from pagedllm.worker.cpu_threads import worker_threads

_SHUTDOWN_WAIT_S = 5.0


def check_data_parallel_size(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"data_parallel_size={value!r} must be an integer >= 1")
    return value


def start_replicas(engine_args, config) -> ReplicaSet | None:
    """Replicas 1.. of the LLM that `engine_args` describes (None for data_parallel_size=1), started before
    replica 0 builds its engine so that they load at the same time."""
    from pagedllm.engine_args import EngineArgs

    size = check_data_parallel_size(engine_args.data_parallel_size)
    if size == 1:
        return None
    kwargs = {name: getattr(engine_args, name) for name in EngineArgs.names()}
    backend = config.parallel.distributed_executor_backend
    return ReplicaSet(kwargs, size, backend, config.device.device.type == "cuda")


def split_evenly(n: int, parts: int) -> list[range]:
    """[0, n) in `parts` contiguous ranges, the first n % parts one longer (some empty when n < parts)."""
    base, extra = divmod(n, parts)
    bounds = [i * base + min(i, extra) for i in range(parts + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(parts)]


def _part(value: Any, rows: range, n: int) -> Any:
    """A per-prompt argument's rows; any other argument whole."""
    if isinstance(value, (list, tuple)) and len(value) == n:
        return list(value[rows.start : rows.stop])
    return value


class ReplicaSet:
    """Replicas 1.. of an LLM (replica 0 is `llm` itself), and the split of a call among all of them."""

    def __init__(self, llm_kwargs: dict, size: int, backend: str | None, on_cuda: bool) -> None:
        world = llm_kwargs["tensor_parallel_size"] * llm_kwargs["pipeline_parallel_size"]
        kwargs = {**llm_kwargs, "data_parallel_size": 1}
        threads = worker_threads(on_cuda, size)
        if backend == "ray":
            self.replicas = [RayReplica(kwargs, world, on_cuda, threads) for _ in range(1, size)]
        else:
            gpus = _visible_gpus(size * world) if on_cuda else []
            self.replicas = [ProcessReplica(kwargs, gpus[i * world : (i + 1) * world], threads) for i in range(1, size)]
        if threads:
            torch.set_num_threads(threads)

    def build_local(self, build: Callable[[], Any]) -> Any:
        """Replica 0's engine, built while the others load; every replica is ended if one fails to start."""
        try:
            engine = build()
            for i, replica in enumerate(self.replicas, start=1):
                _answer(replica.result(), i)
            return engine
        except BaseException:
            self.shutdown()
            raise

    def run(self, llm, method: str, items: list, args: tuple, kwargs: dict) -> list:
        """llm.`method`(items, *args, **kwargs) over the replicas, each on its chunk of items; results in order."""
        n = len(items)
        chunks = split_evenly(n, len(self.replicas) + 1)
        if n <= 1:
            return self._local(llm, method, items, args, kwargs)
        sent = []
        for i, (replica, rows) in enumerate(zip(self.replicas, chunks[1:]), start=1):
            if len(rows):
                part_args = tuple(_part(a, rows, n) for a in args)
                part_kwargs = {k: _part(v, rows, n) for k, v in kwargs.items()}
                if "use_tqdm" in part_kwargs:
                    part_kwargs["use_tqdm"] = False  # the caller's process shows the only bar
                replica.submit(method, items[rows.start : rows.stop], part_args, part_kwargs)
                sent.append((i, replica))
        rows = chunks[0]
        try:
            results = self._local(llm, method, items[: rows.stop], tuple(_part(a, rows, n) for a in args),
                                  {k: _part(v, rows, n) for k, v in kwargs.items()})  # fmt: skip
        finally:
            answers = [(i, replica.result()) for i, replica in sent]  # every replica answers before any raise
        for i, answer in answers:
            results.extend(_answer(answer, i))
        return results

    def _local(self, llm, method: str, items: list, args: tuple, kwargs: dict) -> list:
        replicas, llm.data_parallel = llm.data_parallel, None  # this call runs on replica 0 alone
        try:
            return getattr(llm, method)(items, *args, **kwargs)
        finally:
            llm.data_parallel = replicas

    def shutdown(self) -> None:
        for replica in self.replicas:
            replica.shutdown()


def _answer(answer: tuple, index: int) -> Any:
    """A replica's result, or its error raised here (the same exception type, noted with the replica)."""
    status, value = answer
    if status == "ok":
        return value
    error, trace = value
    error.add_note(f"in data-parallel replica {index}:\n{trace}")
    raise error


def _visible_gpus(needed: int) -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = [v.strip() for v in visible.split(",")] if visible else [str(i) for i in range(torch.cuda.device_count())]
    if len(gpus) < needed:
        raise ValueError(
            f"data_parallel_size * tensor_parallel_size * pipeline_parallel_size = {needed} GPUs, but this machine "
            f"shows {len(gpus)} (CUDA_VISIBLE_DEVICES={visible!r}); use distributed_executor_backend='ray' to span "
            "machines"
        )
    return gpus


class ProcessReplica:
    """One replica in a worker process on this machine, fed calls over a socket pair only the two processes hold."""

    def __init__(self, llm_kwargs: dict, gpus: list[str], threads: int) -> None:
        ours, theirs = multiprocessing.Pipe()
        env = dict(os.environ)
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        fd = theirs.fileno()
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.data_parallel", str(fd)]
        self.proc = subprocess.Popen(cmd, pass_fds=[fd], env=env)
        theirs.close()
        self.conn = ours
        self._finalizer = weakref.finalize(self, _end_process, self.proc, self.conn)
        self._post((llm_kwargs, threads))

    def submit(self, method: str, items: list, args: tuple, kwargs: dict) -> None:
        self._post((method, items, args, kwargs))

    def _post(self, message: Any) -> None:
        try:
            _send(self.conn, message)
        except OSError:  # the process is gone (a broken pipe); result() reports how it ended
            pass

    def result(self) -> tuple:
        try:
            while not self.conn.poll(0.05) and self.proc.poll() is None:
                pass
            return _recv(self.conn)  # EOFError once the process is gone and its last answer read
        except (EOFError, OSError):
            try:
                code = self.proc.wait(_SHUTDOWN_WAIT_S)
            except subprocess.TimeoutExpired:
                code = None
            return "error", (RuntimeError(f"data-parallel replica (pid {self.proc.pid}) exited with code {code}"), "")

    def shutdown(self) -> None:
        self._finalizer()


def _send(conn: Connection, message: Any) -> None:
    """Plain pickling: tensors travel by value (Connection.send would share them through file descriptors, which
    needs a process started by multiprocessing)."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def _end_process(proc: subprocess.Popen, conn: Connection) -> None:
    try:
        _send(conn, ("shutdown", [], (), {}))
    except (OSError, ValueError):
        pass
    try:
        proc.wait(_SHUTDOWN_WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    conn.close()


class ReplicaHost:
    """A replica's LLM and the calls it answers with ("ok", result) or ("error", (exception, traceback))."""

    def __init__(self, llm_kwargs: dict, threads: int) -> None:
        from pagedllm.entrypoints.llm import LLM

        if threads:
            torch.set_num_threads(threads)
        self.llm = LLM(**llm_kwargs)

    def ready(self) -> tuple:
        return "ok", None

    def call(self, method: str, items: list, args: tuple, kwargs: dict) -> tuple:
        try:
            return "ok", getattr(self.llm, method)(items, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - handed to the caller's process
            return _error_answer(e)

    def shutdown(self) -> None:
        self.llm.llm_engine.shutdown()


def _error_answer(error: BaseException) -> tuple:
    trace = traceback.format_exc()
    try:
        pickle.dumps(error)
    except Exception:  # noqa: BLE001 - an exception that does not pickle travels as its text
        error = RuntimeError(f"{type(error).__name__}: {error}")
    return "error", (error, trace)


class RayReplica:
    """One replica in a Ray actor holding W GPUs on a node other than the engine's (its own tensor/pipeline ranks
    run as local processes there)."""

    def __init__(self, llm_kwargs: dict, world: int, on_cuda: bool, threads: int) -> None:
        from pagedllm.distributed.ray_executor import import_ray

        ray = import_ray()
        if not ray.is_initialized():
            ray.init(ignore_reinit_error=True)
        self.ray = ray
        kwargs = {**llm_kwargs, "distributed_executor_backend": "mp" if world > 1 else None}
        resources = dict(num_gpus=world, num_cpus=0) if on_cuda else dict(num_cpus=1)
        if on_cuda:  # replica 0 holds this node's first GPUs outside Ray's accounting: the others go elsewhere
            here = ray.get_runtime_context().get_node_id()
            resources["label_selector"] = {"ray.io/node-id": f"!{here}"}
        self.actor = ray.remote(ReplicaHost).options(**resources).remote(kwargs, threads)
        self.pending = self.actor.ready.remote()

    def submit(self, method: str, items: list, args: tuple, kwargs: dict) -> None:
        self.pending = self.actor.call.remote(method, items, args, kwargs)

    def result(self) -> tuple:
        try:
            return self.ray.get(self.pending)
        except self.ray.exceptions.RayError as e:
            return "error", (RuntimeError(f"data-parallel replica actor failed: {e}"), "")

    def shutdown(self) -> None:
        if self.ray.is_initialized():
            self.ray.kill(self.actor, no_restart=True)


def serve(conn: Connection) -> None:
    """A replica process: the first message builds the LLM (answered once ready); then each message is a call."""
    llm_kwargs, threads = _recv(conn)
    try:
        host = ReplicaHost(llm_kwargs, threads)
    except Exception as e:  # noqa: BLE001 - handed to the caller's process
        _send(conn, _error_answer(e))
        return
    _send(conn, host.ready())
    while True:
        try:
            method, items, args, kwargs = _recv(conn)
        except (EOFError, OSError):
            break
        if method == "shutdown":
            break
        _send(conn, host.call(method, items, args, kwargs))
    host.shutdown()


def main() -> None:
    from pagedllm.distributed.worker import die_with_parent

    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the caller's process, which ends its replicas
    conn = Connection(int(sys.argv[1]))
    try:
        serve(conn)
    finally:
        conn.close()
        os._exit(0)


if __name__ == "__main__":
    main()

"""Worker faults under tensor and pipeline parallelism: a worker that dies or hangs makes generate raise a clear
error within 10 s (no hang); the engine's process ending by SIGTERM or Ctrl-C leaves no worker behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from tiny_models import TINY_DECODER, save_tiny_decoder
from transformers import LlamaConfig, LlamaForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.distributed.mp_executor import WorkerFailed

ENGINE = dict(dtype="float32", skip_tokenizer_init=True, block_size=4, kv_cache_memory_bytes=1 << 22)
PARAMS = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    _, path = save_tiny_decoder("llama-tp-faults", LlamaConfig, LlamaForCausalLM, dict(TINY_DECODER), tmp_path_factory)
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # reaped between the two checks
        return False


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


@pytest.mark.parametrize("layout", [(2, 1), (1, 2)], ids=lambda lay: f"tp{lay[0]}-pp{lay[1]}")
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_dead_or_hung_worker_fails_generate_quickly(how, layout, llama_path):
    """With two pipeline stages the worker is the last stage, which the first waits on for each step's result."""
    llm = LLM(llama_path, tensor_parallel_size=layout[0], pipeline_parallel_size=layout[1], **ENGINE)
    executor = llm.llm_engine.core.executor
    worker = executor.procs[0]
    try:
        assert llm.generate([{"prompt_token_ids": [1, 2, 3]}], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
        os.kill(worker.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(WorkerFailed, match="worker"):
            llm.generate([{"prompt_token_ids": [4, 5, 6]}], PARAMS, use_tqdm=False)
        assert time.monotonic() - start < 12.0
        with pytest.raises(WorkerFailed):  # the engine stays failed, it does not hang
            llm.generate([{"prompt_token_ids": [4, 5, 6]}], PARAMS, use_tqdm=False)
    finally:
        if how == "stop" and _alive(worker.pid):
            os.kill(worker.pid, signal.SIGCONT)
        llm.llm_engine.shutdown()
    assert not _wait_gone([worker.pid], 10.0)


# Ctrl-C as in a terminal: a process started from a non-interactive shell's background job (CI) inherits SIGINT
# ignored, and Python then installs no KeyboardInterrupt handler
_SCRIPT = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
from pagedllm import LLM
llm = LLM(sys.argv[1], tensor_parallel_size=2, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22)
print(" ".join(str(p.pid) for p in llm.llm_engine.core.executor.procs), flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_engine_process_ending_ends_its_workers(sig, llama_path, tmp_path):
    script = tmp_path / "engine.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    proc = subprocess.Popen([sys.executable, str(script), llama_path], stdout=subprocess.PIPE, text=True)
    try:
        workers = [int(p) for p in proc.stdout.readline().split()]
        assert workers and all(_alive(p) for p in workers)
        proc.send_signal(sig)
        proc.wait(timeout=20)
        assert not _wait_gone(workers, 10.0), "a worker outlived the engine's process"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_group_init_failure_names_rank_and_address(llama_path):
    """A rank that cannot reach the rendezvous store fails at once with its rank and the store's address."""
    import socket

    from pagedllm.distributed.parallel_state import RankInfo
    from pagedllm.distributed.worker import Worker, WorkerSpec
    from pagedllm.engine_args import EngineArgs

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = EngineArgs(llama_path, tensor_parallel_size=2, **ENGINE).create_engine_config()
    spec = WorkerSpec(RankInfo(1, 2, 1), "127.0.0.1", port, local_device=0, timeout_s=1.0, num_threads=1)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"rank 1 could not join the gloo groups at 127\.0\.0\.1:{port}"):
        Worker(config, spec)
    assert time.monotonic() - start < 10.0


@pytest.mark.parametrize("gone_before_first_message", [False, True])
def test_a_worker_that_cannot_start_fails_the_llm(llama_path, monkeypatch, gone_before_first_message):
    """A worker whose interpreter cannot start fails LLM() with its rank and exit code, also when it is gone before
    its first message is sent (a broken pipe)."""
    monkeypatch.setenv("PYTHONHOME", "/nonexistent")  # the worker's interpreter cannot start; this one runs on
    if gone_before_first_message:
        real_popen = subprocess.Popen

        def popen_and_wait(*args, **kwargs):
            proc = real_popen(*args, **kwargs)
            proc.wait()
            return proc

        monkeypatch.setattr(subprocess, "Popen", popen_and_wait)
    with pytest.raises(WorkerFailed, match=r"worker rank 1 \(pid \d+\) exited with code 1"):
        LLM(llama_path, tensor_parallel_size=2, **ENGINE)

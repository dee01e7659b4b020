"""The Ray executor: a Ray cluster of two nodes on this machine (a head and a second node, one CPU each, custom
resources node_a and node_b), tensor or pipeline parallelism over both (gloo, float32) with one rank on each node,
gives the greedy tokens and logprobs of one process; a killed actor fails generate within 10 s; data parallelism with a
replica in a Ray actor. Also: the default backend's choice and the missing-extra error."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers as T
from tiny_models import TINY_DECODER, save_tiny_decoder

from pagedllm import LLM, SamplingParams
from pagedllm.distributed import ray_executor
from pagedllm.distributed.mp_executor import WorkerFailed
from pagedllm.distributed.ray_executor import default_backend, import_ray
from pagedllm.entrypoints.data_parallel import RayReplica

ROOT = str(Path(__file__).resolve().parents[2])  # this checkout, for the Ray workers' imports


@pytest.fixture(scope="module")
def two_node_cluster():
    """A Ray head (node_a) and a second node (node_b) on this machine, reached at 127.0.0.1, this process connected
    as the driver; every process of the cluster is ended afterwards (found by the cluster's temp dir in its command
    line)."""
    ray = pytest.importorskip("ray")
    temp = tempfile.mkdtemp(prefix="pagedllm-ray-", dir="/tmp")  # short: Ray's socket paths live under it
    # a local test cluster without token authentication (Ray 2.60 turns it on for a head it starts, and a second
    # node that does not find the head's token cannot join)
    saved_auth = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    ray_cli = [sys.executable, "-c", "from ray.scripts.scripts import main; main()", "start"]
    port = _free_port()
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus=1", "--num-gpus=0", "--disable-usage-stats"]
    try:
        head = [f"--port={port}", "--head", "--include-dashboard=false", f"--temp-dir={temp}", *common]
        subprocess.run([*ray_cli, *head, '--resources={"node_a": 1}'], env=env, check=True, timeout=120)
        second = [f"--address=127.0.0.1:{port}", *common, '--resources={"node_b": 1}']
        subprocess.run([*ray_cli, *second], env=env, check=True, timeout=120)
        ray.init(address=f"127.0.0.1:{port}")
        yield ray
    finally:
        ray.shutdown()
        _end_processes_under(temp)
        shutil.rmtree(temp, ignore_errors=True)
        if saved_auth is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved_auth


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _end_processes_under(temp: str) -> None:
    """Ends the processes whose command line names `temp`, and their descendants."""
    parents: dict[int, int] = {}
    roots = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if temp in cmdline:
            roots.add(int(entry.name))
    pids, grew = set(roots), True
    while grew:
        more = {pid for pid, ppid in parents.items() if ppid in pids} - pids
        pids |= more
        grew = bool(more)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        time.sleep(1.0)


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        (o.outputs[0].token_ids, [s[t].logprob for s, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
        for o in outs
    ]


BASE = dict(dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22, block_size=4)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama, its greedy outputs in one process for PROMPTS."""
    _, path = save_tiny_decoder("llama-ray", T.LlamaConfig, T.LlamaForCausalLM, dict(TINY_DECODER), tmp_path_factory)
    return path, _greedy(LLM(path, **BASE), PROMPTS)


PROMPTS = [torch.randint(0, 320, (int(n),), generator=torch.Generator().manual_seed(3)).tolist() for n in (1, 13, 22)]


def _assert_matches(got: list, expected: list) -> None:
    assert len(got) == len(expected)
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, expected):
        assert tokens == ref_tokens
        np.testing.assert_allclose(logprobs, ref_logprobs, atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [(2, 1), (1, 2)], ids=lambda lay: f"tp{lay[0]}-pp{lay[1]}")
def test_two_ranks_across_two_ray_nodes_match_one_process(layout, two_node_cluster, tiny_llama):
    """TP=2, and PP=2 with its two batches in flight (the later stage's actor takes its steps in order)."""
    ray = two_node_cluster
    path, expected = tiny_llama
    prompts = PROMPTS
    tp, pp = layout
    llm = LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, distributed_executor_backend="ray",
              max_num_batched_tokens=16, **BASE)  # fmt: skip
    try:
        executor = llm.llm_engine.core.executor
        assert isinstance(executor, ray_executor.RayExecutor)
        nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
        ranks = executor.node_ids()
        assert len(set(ranks)) == 2, ranks  # one rank on each node
        assert {k for r in ranks for k in nodes[r] if k.startswith("node_")} == {"node_a", "node_b"}
        _assert_matches(_greedy(llm, prompts), expected)
        assert llm.llm_engine.core.max_batches_in_flight == (2 if pp == 2 else 0)
    finally:
        llm.llm_engine.shutdown()
    for actor in executor.actors:  # ended with the engine
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.node_id.remote(), timeout=60)


@pytest.mark.slow
def test_a_dead_ray_worker_fails_generate_quickly(two_node_cluster, tiny_llama):
    ray = two_node_cluster
    path, expected = tiny_llama
    llm = LLM(path, tensor_parallel_size=2, distributed_executor_backend="ray", **BASE)
    try:
        _assert_matches(_greedy(llm, PROMPTS[:1]), expected[:1])
        ray.kill(llm.llm_engine.core.executor.actors[0], no_restart=True)
        start = time.monotonic()
        with pytest.raises(WorkerFailed, match="Ray worker failed"):
            _greedy(llm, PROMPTS)
        assert time.monotonic() - start < 10
        with pytest.raises(WorkerFailed):  # and stays failed
            _greedy(llm, PROMPTS)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.slow
def test_dp2_on_ray_matches_one_process(two_node_cluster, tiny_llama):
    path, expected = tiny_llama
    llm = LLM(path, data_parallel_size=2, distributed_executor_backend="ray", **BASE)
    try:
        (replica,) = llm.data_parallel.replicas
        assert isinstance(replica, RayReplica)
        _assert_matches(_greedy(llm, PROMPTS), expected)  # the first prompts here, the last in the actor
    finally:
        llm.data_parallel.shutdown()
        llm.llm_engine.shutdown()


def _config(device: str, world: int):
    parallel = SimpleNamespace(world_size=world)
    return SimpleNamespace(device=SimpleNamespace(device=torch.device(device)), parallel=parallel)


def test_default_backend_picks_ray_only_beyond_this_machines_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    fake_ray = SimpleNamespace(is_initialized=lambda: False)
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    assert default_backend(_config("cuda", 4)) == "mp"  # no cluster reached
    fake_ray.is_initialized = lambda: True
    assert default_backend(_config("cuda", 4)) == "ray"
    assert default_backend(_config("cuda", 2)) == "mp"  # fits this machine
    assert default_backend(_config("cpu", 4)) == "mp"
    fake_ray.is_initialized = lambda: False
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    monkeypatch.setattr(ray_executor.importlib.util, "find_spec", lambda name: object())
    assert default_backend(_config("cuda", 4)) == "ray"


def test_missing_ray_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'pagedllm\[ray\]'"):
        import_ray()

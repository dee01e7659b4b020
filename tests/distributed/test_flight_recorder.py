"""torch's flight recorder (a record of every collective, with its stack, on the host path of every step) is off in
pagedllm's groups unless the user sized it (distributed/communicator.py: quiet_flight_recorder)."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import socket

import torch
import torch.distributed as dist

from pagedllm.distributed.communicator import Communicator, quiet_flight_recorder


def test_quiet_flight_recorder_keeps_a_user_setting():
    env = {}
    quiet_flight_recorder(env)
    assert env == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        env = {name: "100"}
        quiet_flight_recorder(env)
        assert env == {name: "100"}


def _rank(rank: int, port: int, user_size: str | None, out) -> None:
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        os.environ.pop(name, None)
    if user_size is not None:
        os.environ["TORCH_FR_BUFFER_SIZE"] = user_size
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    comm = Communicator.create(store, "tp", rank, [0, 1], torch.device("cpu"), 30.0)
    x = torch.zeros(4, dtype=torch.int64)
    for _ in range(3):
        comm.broadcast(x, 0)
    comm.barrier()
    if rank == 0:
        out.put(len(pickle.loads(torch._C._distributed_c10d._dump_fr_trace()).get("entries", [])))
    comm.shutdown()


def _recorded(user_size: str | None) -> int:
    """Collectives the flight recorder kept in a fresh rank-0 process of a two-rank gloo group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, user_size, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=120)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def test_groups_record_no_collectives_unless_asked():
    assert _recorded(None) == 0
    assert _recorded("100") > 0  # the user's setting is kept: the recorder runs

"""A draft model's or EAGLE head's drafts on several ranks (tensor and pipeline parallelism).

The driver (rank 0) alone holds the draft model or head, its KV cache and its graphs (the draft is small: one copy,
on one GPU, with no collectives in its passes; an EAGLE head there uses whole copies of the target's vocabulary
tables, spec_decode/eagle.py). A verify step embeds its input ids, the drafts among them, on every rank
of the first pipeline stage, so those ranks get the drafts: the engine sends them the request ids of each proposal,
and after the draft passes the driver broadcasts the drafts over its tensor-parallel group as one [n, K] tensor,
a row per request asked for (UNKNOWN where a request got none), queued on the device behind the passes. Each peer
wraps what it receives as the driver's DeviceDrafts: the same placeholders for the scheduler, the same values for
the verify step's inputs and a penalized request's penalties. The later stages take hidden states, not tokens:
they get no drafts. Drafts from a broadcast are the driver's bits, so the ranks agree however the draft computes."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pagedllm.spec_decode.device_drafts import UNKNOWN, DeviceDrafts


def drafts_peers(runner):
    """The driver's peers that take the drafts: its tensor-parallel group (None with one rank a stage)."""
    return runner.groups.tp if runner.groups.info.tp_size > 1 else None


def share_drafts(peers, req_ids: list[str], drafts: Mapping, k: int, device: torch.device) -> None:
    """The driver's side: the proposal's drafts (a DeviceDrafts, or {} when no request got any) as [len(req_ids), K]
    rows in req_ids' order, broadcast to its peers."""
    tokens = getattr(drafts, "tokens", None)
    if tokens is not None and list(drafts.index) == req_ids:
        rows = tokens
    else:
        rows = torch.full((len(req_ids), k), UNKNOWN, dtype=torch.int64, device=device)
        if tokens is not None:
            where = {r: i for i, r in enumerate(req_ids)}
            dst = torch.tensor([where[r] for r in drafts.index], dtype=torch.int64).to(device)
            rows.index_copy_(0, dst, tokens)
    peers.broadcast(rows.contiguous(), 0)


class ReceivedDrafts:
    """A follower rank's drafter: the driver's drafts, received (first stage) or none (later stages). It has no
    model, KV cache or graphs of its own."""

    def __init__(self, runner, k: int) -> None:
        self.k, self.device = k, runner.device
        first_stage = runner.stage is None or runner.stage.is_first
        self.peers = drafts_peers(runner) if first_stage else None
        self.pending: DeviceDrafts | None = None  # the last proposal's drafts

    def propose(self, token_ids: Mapping[str, object]) -> Mapping[str, list[int]]:
        """The driver's drafts for these request ids (in the engine's order), as a DeviceDrafts."""
        req_ids = list(token_ids)
        if self.peers is None or not req_ids:
            self.pending = None
            return {}
        rows = torch.empty((len(req_ids), self.k), dtype=torch.int64, device=self.device)
        self.peers.broadcast(rows, 0)
        self.pending = DeviceDrafts(req_ids, rows)
        return self.pending

    def kv_bytes_per_block(self) -> int:
        return 0

    def allocate_kv_cache(self, num_blocks: int) -> None:
        pass

    def capture_cudagraphs(self) -> float:
        return 0.0

    def record_step(self, flat, hidden: torch.Tensor, drafts) -> None:
        pass

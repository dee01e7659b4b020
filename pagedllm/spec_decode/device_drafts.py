"""Drafts that stay on the device until the step that verifies them.

A draft model (or an EAGLE head) proposes K tokens per row on the device. Reading them on the host would make the
host wait for the draft passes before it schedules the verifying step, and leave the device idle while it does.
Instead the proposal is a `DeviceDrafts`: the scheduler sees placeholder drafts (UNKNOWN, K per request: their
number is all it needs), the runner fills the verifying step's input ids from the device tensor, and the values
reach the host in a copy queued behind the draft passes, read once the verify step's tokens are back (they are
then long there). The host schedules and launches the verify step while the draft passes run.

Where the values are needed before the step runs they are read then (the host waits for the draft passes): a
request with a grammar (its drafts are checked against it, and its masks follow them) and a penalized request (its
penalties at a draft position count the drafts before it)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np
import torch

UNKNOWN = -1  # a draft token whose value is on the device (token ids are never negative)


class DeviceDrafts(Mapping):
    """request id -> its drafts as placeholders ([UNKNOWN] * K); `tokens_of` gives the tokens themselves."""

    def __init__(self, req_ids: list[str], tokens: torch.Tensor) -> None:
        self.tokens = tokens  # [m, K] int64 on the device
        self.index = {r: i for i, r in enumerate(req_ids)}  # request id -> its row in tokens
        self.k = tokens.shape[1]
        self._host = tokens
        self._copied = None
        if tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    def __getitem__(self, req_id: str) -> list[int]:
        self.index[req_id]  # (KeyError for a request without drafts)
        return [UNKNOWN] * self.k

    def __iter__(self) -> Iterator[str]:
        return iter(self.index)

    def __len__(self) -> int:
        return len(self.index)

    def host(self) -> np.ndarray:
        """[m, K] the drafts on the host (waits for the draft passes if they are still running)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        return self._host.numpy()

    def tokens_of(self, req_id: str) -> list[int]:
        return self.host()[self.index[req_id]].tolist()

    def fill_inputs(
        self, req_ids: list[str], drafts: list[list[int]], query_end: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The verify step's draft inputs still on the device: per request (of the flat batch, in order) the drafts
        it verifies (UNKNOWN where they are ours) and one past its last scheduled token in the flat batch -> (their
        places in the flat input ids, their values), both on the device (None: no draft of ours)."""
        places, src = [], []
        for req_id, d, end in zip(req_ids, drafts, query_end.tolist()):
            if d and d[0] == UNKNOWN:
                places.append(np.arange(end - len(d), end))
                src.append(self.index[req_id] * self.k + np.arange(len(d)))
        if not places:
            return None
        index = torch.from_numpy(np.stack([np.concatenate(places), np.concatenate(src)]))
        if self.tokens.is_cuda:
            index = index.pin_memory().to(self.tokens.device, non_blocking=True)
        return index[0], self.tokens.reshape(-1).index_select(0, index[1])


def resolve(spec: dict[str, list[int]], pending: DeviceDrafts | None, req_ids) -> None:
    """Replaces the placeholders of these requests' drafts in spec by their values, in place."""
    for req_id in req_ids:
        d = spec.get(req_id)
        if d and d[0] == UNKNOWN:
            spec[req_id] = pending.tokens_of(req_id)[: len(d)]

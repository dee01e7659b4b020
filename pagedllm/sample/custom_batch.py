"""The engine's instances of the LogitsProcessor classes (sample/custom_logits.py) and the batch they see.

Their batch is the step's sampled requests in logits order (index i: row i of the logits `apply` gets), as vLLM's
is its scheduled requests in its persistent batch's order. The runner's persistent batch keeps a request on one row
from its admission to its end and samples any subset of the rows in any order, so each step that samples compares
its requests with the previous one's: a request no longer there is removed (it finished, was preempted or is not
scheduled this step, as vLLM removes an unscheduled request and adds it back), a new admission is added (a
preempted request comes back as a new one, with its outputs so far), and moves put every request at its logits row.
Requests are told apart by their admission (InputBatch.generation), so a request id used again is a new request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagedllm.sample.custom_logits import BatchUpdate, LogitsProcessor, MoveDirectionality

if TYPE_CHECKING:  # the runner's persistent batch
    from pagedllm.worker.input_batch import InputBatch


class CustomLogitsProcessors:
    def __init__(self, classes: tuple[type[LogitsProcessor], ...], config: Any, device: torch.device) -> None:
        pin = device.type == "cuda"
        processors = [cls(config, device, pin) for cls in classes]
        self.always = [p for p in processors if not p.is_argmax_invariant()]
        self.sampling = [p for p in processors if p.is_argmax_invariant()]  # skipped when every row is greedy
        self.order: list[int] = []  # index -> the admission of the request there (the last update's batch)
        self.outputs: dict[int, list[int]] = {}  # admission -> its output tokens (the list the processors hold)

    def update(self, batch: InputBatch, rows: np.ndarray) -> BatchUpdate | None:
        """Before a step that samples these rows of the persistent batch (in logits order): brings every output
        list up to date, then hands each processor the change of its batch (None: no change)."""
        gens = batch.generation[rows].tolist()
        for gen, row in zip(gens, rows.tolist()):
            out = self.outputs.get(gen)
            if out is not None:  # the tokens committed since (the rows of this step's requests are all on the host)
                out.extend(batch.token_ids[row, batch.num_prompt[row] + len(out) : batch.num_tokens[row]].tolist())
        update = self._change(batch, rows, gens)
        for p in (*self.always, *self.sampling):
            p.update_state(update)
        return update

    def _change(self, batch: InputBatch, rows: np.ndarray, gens: list[int]) -> BatchUpdate | None:
        kept = set(gens)
        removed = [i for i, g in enumerate(self.order) if g not in kept]
        for i in removed:
            self.outputs.pop(self.order[i], None)
        slot = {g: i for i, g in enumerate(self.order) if g in kept}  # admission -> its index now
        holder = {i: g for g, i in slot.items()}  # index -> admission
        new = [(pos, g) for pos, g in enumerate(gens) if g not in slot]
        for pos, g in new:  # at its own row where that is free
            if pos not in holder:
                slot[g], holder[pos] = pos, g
        free = iter(i for i in range(max(len(self.order), len(gens))) if i not in holder)
        added = []
        for pos, g in new:
            if g not in slot:  # at a free index, moved to its row below
                i = next(free)
                slot[g], holder[i] = i, g
            row = int(rows[pos])
            n = int(batch.num_prompt[row])
            self.outputs[g] = batch.token_ids[row, n : batch.num_tokens[row]].tolist()
            added.append((slot[g], batch.params[row], batch.token_ids[row, :n].tolist(), self.outputs[g]))
        moved = []
        for pos, g in enumerate(gens):
            at = slot[g]
            if at == pos:
                continue
            other = holder.pop(pos, None)
            del holder[at]
            if other is None:
                moved.append((at, pos, MoveDirectionality.UNIDIRECTIONAL))
            else:
                moved.append((at, pos, MoveDirectionality.SWAP))
                slot[other], holder[at] = at, other
            slot[g], holder[pos] = pos, g
        self.order = gens
        if not (removed or added or moved):
            return None
        return BatchUpdate(len(gens), removed, added, moved)

    def apply(self, logits: torch.Tensor, all_greedy: bool) -> torch.Tensor:
        """The step's logits [batch_size, vocab] through every processor (the argmax-invariant ones only when some
        row samples at a temperature)."""
        for p in self.always if all_greedy else (*self.always, *self.sampling):
            logits = p.apply(logits)
        return logits

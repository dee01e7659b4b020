"""A request id used again, by a request without logits processors, right after one with them finished: the runner
does not hand the old request's processors to the new one, and its row counts as plain on every rank (the driver,
which keeps the processors, and a follower, which never sees them), so the ranks agree on how the step samples."""

from __future__ import annotations

import numpy as np

from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.input_batch import InputBatch
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.scheduler_output import NewRequestData, SchedulerOutput


class _Runner:
    """What ModelRunner._update_batch reads and writes."""

    def __init__(self):
        self.batch = InputBatch(4, 32, 4)
        self.logits_processors = {}


def _new(with_processors: bool) -> NewRequestData:
    return NewRequestData("x", [1, 2, 3], 3, SamplingParams(temperature=0.7), [], 0, [], None, [], with_processors)


def test_a_reused_id_gets_no_stale_processors_and_the_ranks_agree():
    driver, follower = _Runner(), _Runner()
    ModelRunner.register_logits_processors(driver, "x", [lambda out, logits: logits])
    for runner in (driver, follower):
        ModelRunner._update_batch(runner, SchedulerOutput([_new(True)], [], {"x": 3}, 3))
        assert not runner.batch.plain[runner.batch.row_of["x"]]
    # the first "x" finishes in the same step that admits a new "x" without processors
    so = SchedulerOutput([_new(False)], [], {"x": 3}, 3, finished_req_ids={"x"})
    for runner in (driver, follower):
        ModelRunner._update_batch(runner, so)
    rows = [np.array([r.batch.row_of["x"]]) for r in (driver, follower)]
    assert driver.batch.plain[rows[0]].all() and follower.batch.plain[rows[1]].all()
    assert not driver.batch.logits_processors and "x" not in driver.logits_processors

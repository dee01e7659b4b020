"""Tensor and pipeline parallelism: process groups (communicator, parallel_state), the worker every rank runs
(worker) and the executors that start and drive the workers (mp_executor: local processes; ray_executor: Ray
actors on one or several machines)."""

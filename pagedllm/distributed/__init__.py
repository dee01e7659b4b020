"""Tensor and pipeline parallelism: process groups (communicator, parallel_state), the worker every rank runs
(worker) and the executors that start and drive the workers (mp_executor: local processes; ray_executor: Ray
actors on one or several machines)."""


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """vLLM's helper that scripts call between two LLMs: frees what the last engine left (Python garbage, the
    allocator's cached GPU memory) and, with shutdown_ray, ends this process's Ray connection. An LLM's own workers
    and process groups end with its shutdown or when it is collected."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if shutdown_ray:
        try:
            import ray
        except ImportError:
            return
        ray.shutdown()

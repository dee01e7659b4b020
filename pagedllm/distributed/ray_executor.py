"""The Ray executor: rank 0 in the engine's process, ranks 1.. as Ray actors on the nodes of a Ray cluster.

The actors run the same `Worker` as the local processes do. They live in a placement group of one bundle per rank
({"GPU": 1} on CUDA, {"CPU": 1} on CPU), bundle 0 on the engine's node for rank 0; the group is packed on that node
(STRICT_PACK) when the node holds every bundle, else spread over as few nodes as possible (PACK). The ranks meet
through a TCPStore on the engine's node address. Each step is one method call per actor (Ray runs an actor's calls
in order); the step's future also checks the actors' finished calls, so an actor's error surfaces in result()."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
import weakref
from dataclasses import replace

import torch
import torch.distributed as dist

from pagedllm.config import EngineConfig
from pagedllm.distributed.mp_executor import RanksExecutor, WorkerFailed
from pagedllm.distributed.parallel_state import RankInfo
from pagedllm.distributed.worker import Worker, WorkerSpec, warm_cpu_kernels
from pagedllm.worker.cpu_threads import worker_threads
from pagedllm.worker.scheduler_output import ModelRunnerOutput, SchedulerOutput

PLACEMENT_TIMEOUT_S = 60.0  # the cluster has this long to reserve every rank's bundle
NODE_ID_LABEL = "ray.io/node-id"


def import_ray():
    """Ray, or an error naming the extra that installs it."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            "distributed_executor_backend='ray' needs Ray, an optional extra: pip install 'pagedllm[ray]'"
        ) from e
    return ray


def ray_cluster_reachable() -> bool:
    """Ray is initialized in this process, or RAY_ADDRESS names a cluster (never imports Ray otherwise)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return True
    return bool(os.environ.get("RAY_ADDRESS")) and importlib.util.find_spec("ray") is not None


def default_backend(config: EngineConfig) -> str:
    """distributed_executor_backend=None: "ray" when the ranks need more GPUs than this machine has and a Ray
    cluster is reached, else "mp"."""
    on_cuda = config.device.device.type == "cuda"
    if on_cuda and torch.cuda.device_count() < config.parallel.world_size and ray_cluster_reachable():
        return "ray"
    return "mp"


class RayWorker:
    """One follower rank inside a Ray actor."""

    def __init__(self) -> None:
        self.worker: Worker | None = None

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def warm(self, config: EngineConfig) -> None:
        """Imports and builds the CPU kernels before the groups' rendezvous, so that no rank waits on another."""
        warm_cpu_kernels(config.device.device)

    def start(self, config: EngineConfig, spec: WorkerSpec) -> None:
        if config.device.device.type == "cuda":
            spec = replace(spec, local_device=assigned_gpu_index())
        self.worker = Worker(config, spec)

    def call(self, method: str, *args):
        return getattr(self.worker, method)(*args)

    def launch(self, so: SchedulerOutput) -> None:
        self.worker.launch(so)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()


class GpuHolder:
    """Holds bundle 0 (the engine's GPU) so that no actor takes the GPU rank 0 runs on; tells which one it is."""

    def gpu_id(self) -> str:
        import ray

        return str(ray.get_gpu_ids()[0])


def assigned_gpu_index() -> int:
    """This actor's GPU as a CUDA index: its position among CUDA_VISIBLE_DEVICES (Ray narrows them to the
    actor's GPUs), or the id itself where Ray leaves the variable alone."""
    import ray

    return visible_index(str(ray.get_gpu_ids()[0]))


def visible_index(gpu_id: str) -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return int(gpu_id)
    ids = [v.strip() for v in visible.split(",")]
    if gpu_id not in ids:
        raise RuntimeError(f"Ray assigned GPU {gpu_id}, not among CUDA_VISIBLE_DEVICES={visible!r}")
    return ids.index(gpu_id)


class RayExecutor(RanksExecutor):
    def __init__(self, config: EngineConfig) -> None:
        ray = import_ray()
        if not ray.is_initialized():
            ray.init(ignore_reinit_error=True)  # RAY_ADDRESS, a cluster started on this machine, or a new one
        self.ray = ray
        p = config.parallel
        world = p.world_size
        on_cuda = config.device.device.type == "cuda"
        self.failure: str | None = None
        self.inflight: list = []  # the actors' step calls not seen finished yet
        self.actors: list = []  # ranks 1.., in rank order
        self.owned: list = []  # every actor this executor started (the actors and bundle 0's GPU holder)
        self.pg = self._placement_group(world, on_cuda)
        self._finalizer = weakref.finalize(self, _end_actors, ray, self.owned, self.pg)
        try:
            self._start(config, world, on_cuda)
        except BaseException as e:
            self.shutdown()
            raise self._error(e) from e

    def _placement_group(self, world: int, on_cuda: bool):
        from ray.util.placement_group import placement_group, remove_placement_group

        key = "GPU" if on_cuda else "CPU"
        here = self.ray.get_runtime_context().get_node_id()
        node = next((n for n in self.ray.nodes() if n["NodeID"] == here), {})
        strategy = "STRICT_PACK" if node.get("Resources", {}).get(key, 0) >= world else "PACK"
        selectors = [{NODE_ID_LABEL: here}] + [{} for _ in range(world - 1)]  # rank 0 on the engine's node
        hint = dict(_soft_target_node_id=here) if strategy == "STRICT_PACK" else {}  # labels alone: newer Ray
        pg = placement_group([{key: 1}] * world, strategy=strategy, bundle_label_selector=selectors, **hint)
        ready, _ = self.ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(pg)
            raise RuntimeError(
                f"the Ray cluster could not place {world} bundles of {{{key!r}: 1}} (one per rank, the first on "
                f"this node) within {PLACEMENT_TIMEOUT_S:.0f} s; cluster resources: {self.ray.cluster_resources()}, "
                f"available: {self.ray.available_resources()}"
            )
        return pg

    def _options(self, rank: int, on_cuda: bool) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        resources = dict(num_gpus=1, num_cpus=0) if on_cuda else dict(num_cpus=1)
        strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank)
        return dict(**resources, scheduling_strategy=strategy)

    def _start(self, config: EngineConfig, world: int, on_cuda: bool) -> None:
        p = config.parallel
        ray = self.ray
        driver_device = config.device.device.index or 0
        if on_cuda:  # rank 0 runs on the GPU Ray reserved for bundle 0
            holder = ray.remote(GpuHolder).options(**self._options(0, on_cuda)).remote()
            self.owned.append(holder)
            driver_device = visible_index(self._get([holder.gpu_id.remote()])[0])
        threads = worker_threads(on_cuda, world)
        host = ray.util.get_node_ip_address()
        store = dist.TCPStore(host, 0, world, is_master=True, wait_for_workers=False)
        actor_cls = ray.remote(RayWorker)
        self.actors.extend(actor_cls.options(**self._options(r, on_cuda)).remote() for r in range(1, world))
        self.owned.extend(self.actors)
        # the logits processor classes run on the driver: a follower gets their names (classes may not pickle)
        names = tuple(cls.__qualname__ for cls in config.logits_processors)
        follower_config = replace(config, speculative_proposer=None, logits_processors=names)
        self._get([a.warm.remote(follower_config) for a in self.actors])
        base = dict(store_host=host, store_port=store.port, timeout_s=p.distributed_timeout_s, num_threads=threads)
        starts = [
            a.start.remote(
                follower_config,
                WorkerSpec(RankInfo(r, p.tensor_parallel_size, p.pipeline_parallel_size), local_device=0, **base),
            )  # fmt: skip
            for r, a in enumerate(self.actors, start=1)
        ]
        if threads:
            torch.set_num_threads(threads)
        if on_cuda:
            config = replace(config, device=replace(config.device, device=torch.device("cuda", driver_device)))
        spec0 = WorkerSpec(RankInfo(0, p.tensor_parallel_size, p.pipeline_parallel_size), **base,
                           local_device=driver_device)  # fmt: skip
        self.driver = Worker(config, spec0, store)
        self._get(starts)

    def node_ids(self) -> list[str]:
        """The Ray node of each rank, in rank order."""
        here = self.ray.get_runtime_context().get_node_id()
        return [here, *self._get([a.node_id.remote() for a in self.actors])]

    def _get(self, refs: list) -> list:
        try:
            return self.ray.get(refs)
        except (self.ray.exceptions.RayError, self.ray.exceptions.GetTimeoutError) as e:
            self.failure = self.failure or str(e)
            raise WorkerFailed(f"a tensor/pipeline-parallel Ray worker failed: {e}") from e

    def poll(self) -> None:
        """Raises an actor's error among its finished step calls; never waits."""
        self._check()
        if not self.inflight:
            return
        done, self.inflight = self.ray.wait(self.inflight, num_returns=len(self.inflight), timeout=0)
        if done:
            self._get(done)

    def _error(self, error: BaseException) -> BaseException:
        """The error to raise for `error`: an actor's own error where one failed (waiting up to a second for it)."""
        if isinstance(error, WorkerFailed):
            return error
        if self.inflight:
            done, _ = self.ray.wait(self.inflight, num_returns=len(self.inflight), timeout=1.0)
            try:
                self.ray.get(done)
            except self.ray.exceptions.RayError as e:
                self.failure = self.failure or str(e)
        if self.failure is None and not isinstance(error, (RuntimeError, dist.DistBackendError)):
            return error
        self.failure = self.failure or str(error)
        self._finalizer()
        return WorkerFailed(f"a tensor/pipeline-parallel Ray worker failed: {self.failure}")

    def _check(self) -> None:
        if self.failure is not None:
            raise WorkerFailed(f"a tensor/pipeline-parallel Ray worker failed: {self.failure}")

    def _call(self, method: str, *args) -> list:
        """Calls `method` on every rank; returns [driver's answer, actors' answers...]."""
        self.poll()
        try:
            refs = [a.call.remote(method, *args) for a in self.actors]
            mine = getattr(self.driver, method)(*args)
            return [mine, *self._get(refs)]
        except BaseException as e:
            raise self._error(e) from e

    def _post(self, method: str, *args) -> None:
        self.poll()
        self.inflight.extend(a.call.remote(method, *args) for a in self.actors)

    def launch(self, scheduler_output: SchedulerOutput) -> RayStepFuture:
        self.poll()
        try:
            follower_so = self.ray.put(replace(scheduler_output, grammar_bitmask={}))  # the driver alone samples
            self.inflight.extend(a.launch.remote(follower_so) for a in self.actors)
            info = self.driver.info  # with pipeline stages the driver's first-stage peers finish each step with it
            finishers = self.actors[: info.tp_size - 1] if info.pp_size > 1 else ()
            return RayStepFuture(self.driver.launch(scheduler_output), self, finishers)
        except BaseException as e:
            raise self._error(e) from e

    def shutdown(self) -> None:
        if hasattr(self, "driver"):
            self.driver.shutdown()
        self._finalizer()


class RayStepFuture:
    """A step's future that stops waiting, with the actor's error, when an actor's call fails meanwhile."""

    def __init__(self, future, executor: RayExecutor, finishers=()) -> None:
        self.future, self.executor, self.finishers = future, executor, finishers

    def sample(self) -> None:
        """A pipelined step's sampling queued on the device, by the driver and its first-stage peers."""
        if self.finishers:
            self.executor.inflight.extend(a.call.remote("finish") for a in self.finishers)
            self.finishers = ()
        try:
            self.future.sample()
        except BaseException as e:
            raise self.executor._error(e) from e

    def result(self) -> ModelRunnerOutput:
        self.sample()
        while not self.future.done():  # the device may wait on a collective a failed peer will never join
            self.executor.poll()
            time.sleep(0.001)
        try:
            return self.future.result()
        except BaseException as e:
            raise self.executor._error(e) from e


def _end_actors(ray, actors: list, pg) -> None:
    """Ends the actors and frees their placement group (also at interpreter exit, while Ray is still up)."""
    if not ray.is_initialized():
        return
    from ray.util.placement_group import remove_placement_group

    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
    try:
        remove_placement_group(pg)
    except Exception:  # noqa: BLE001 - already removed, or the cluster is gone
        pass

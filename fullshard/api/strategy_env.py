"""Where this rank runs: the job facts `FSDPStrategy` reports (ranks, devices, backend, the
cluster environment) and the process group's life (`setup_environment`, `teardown`).

A mixin of `FSDPStrategy`, split out to keep one concern per file; it reads the attributes the
strategy's constructor sets: `accelerator`, `parallel_devices`, `cluster_environment`,
`device_mesh`, `_timeout`, `_num_nodes`, `_launcher`, `_process_group_backend`. The cluster
environment may be ours (`fullshard.launch.environment`) or Lightning's (it has
`set_world_size` / `set_global_rank` instead of `set_world_ranks`).
"""

from __future__ import annotations

import atexit
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fullshard.launch.environment import ClusterEnvironment, detect_environment
from fullshard.launch.subprocess_script import destroy_process_group_at_exit


class RankPlacement:
    """The job facts and the process group of an `FSDPStrategy` (see the module docstring)."""

    accelerator: str | None
    parallel_devices: list[torch.device] | None
    cluster_environment: ClusterEnvironment | None
    device_mesh: Any
    _timeout: timedelta | None
    _num_nodes: int
    _launcher: Any
    _process_group_backend: str | None

    @property
    def timeout(self) -> timedelta | None:
        return self._timeout

    @property
    def launcher(self) -> Any:
        return self._launcher

    def _environment(self) -> ClusterEnvironment:
        if self.cluster_environment is None:
            self.cluster_environment = detect_environment()
        return self.cluster_environment

    def _devices(self) -> list[torch.device]:
        if self.parallel_devices is None:
            from fullshard.launch.environment import launched_world_size

            n = launched_world_size() or 1
            if self._accelerator_type() == "cuda":
                self.parallel_devices = [torch.device("cuda", i) for i in range(n)]
            else:
                self.parallel_devices = [torch.device("cpu")] * n
        return self.parallel_devices

    def _accelerator_type(self) -> str:
        """'cpu' or 'cuda': the accelerator set (a name here; the Lightning strategy also takes
        Lightning's accelerator objects), else CUDA when available. Not stored: whoever sets
        the accelerator later (Fabric) must find it unset."""
        if self.accelerator is None:
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.accelerator

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, value: int) -> None:
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"num_nodes must be an int >= 1, got {value!r}")
        self._num_nodes = value

    @property
    def num_processes(self) -> int:
        return len(self._devices())

    @property
    def world_size(self) -> int:
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
        return self._environment().world_size()

    @property
    def global_rank(self) -> int:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
        return self._environment().global_rank()

    @property
    def local_rank(self) -> int:
        return self._environment().local_rank()

    @property
    def node_rank(self) -> int:
        return self._environment().node_rank()

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def root_device(self) -> torch.device:
        devices = self._devices()
        if self._accelerator_type() == "cuda":
            return devices[self.local_rank % len(devices)]
        return torch.device("cpu")

    @property
    def process_group_backend(self) -> str:
        if self._process_group_backend is not None:
            return self._process_group_backend
        return "nccl" if self.root_device.type == "cuda" else "gloo"

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """Every rank is a data-parallel rank (replicate and shard axes alike)."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def _set_world_ranks(self) -> None:
        env = self._environment()
        n = self.num_processes
        world, rank = self.num_nodes * n, self.node_rank * n + self.local_rank
        if hasattr(env, "set_world_ranks"):
            env.set_world_ranks(world_size=world, global_rank=rank)
        else:  # a Lightning ClusterEnvironment: one setter each
            env.set_world_size(world)
            env.set_global_rank(rank)

    def _configure_launcher(self) -> None:
        """A launcher that starts the local ranks, unless something else already started them."""
        from fullshard.launch.subprocess_script import SubprocessScriptLauncher

        env = self._environment()
        if env.creates_processes_externally:
            self._launcher = None
        else:
            self._launcher = SubprocessScriptLauncher(
                env, num_processes=self.num_processes, num_nodes=self.num_nodes
            )

    def validate_world(self, world_size: int) -> None:
        """Check what depends on the world size (the mesh) before any process group exists."""
        mesh = self.device_mesh
        if isinstance(mesh, tuple) and mesh[0] * mesh[1] != world_size:
            raise ValueError(
                f"FSDPStrategy(device_mesh={mesh}) has {mesh[0] * mesh[1]} ranks but the world "
                f"size is {world_size}. Choose (replicate, shard) with replicate * shard == "
                f"{world_size}, e.g. ({max(1, world_size // mesh[1])}, {mesh[1]}) if that "
                f"divides evenly, or leave device_mesh=None for (nodes, ranks per node)."
            )

    def setup_environment(self) -> None:
        """Join (or create) the default process group for this rank."""
        from torch.distributed.constants import default_pg_timeout

        from fullshard.launch.subprocess_script import install_rank_hooks
        from fullshard.launch.torchrun import attempt_store

        env = self._environment()
        self._set_world_ranks()
        world = env.world_size()
        self.validate_world(world)
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", env.main_address)
            os.environ.setdefault("MASTER_PORT", str(env.main_port))
            kwargs: dict[str, Any] = {}
            if self._timeout is not None:
                kwargs["timeout"] = self._timeout
            store = attempt_store(self._timeout or default_pg_timeout)  # restarts: see there
            if store is not None:
                kwargs["store"] = store
            dist.init_process_group(
                self.process_group_backend, rank=env.global_rank(), world_size=world, **kwargs
            )
            # Exiting with a live gloo/NCCL group can abort in its destructors at shutdown.
            atexit.register(destroy_process_group_at_exit)
        elif dist.get_world_size() != world and "WORLD_SIZE" in os.environ:
            raise ValueError(
                f"torch.distributed is already initialized with world size "
                f"{dist.get_world_size()}, but the environment says {world}."
            )
        self.validate_world(dist.get_world_size())
        install_rank_hooks(dist.get_rank(), self.local_rank)

    def teardown(self) -> None:
        """End the run in this process: stop the launcher's watch threads and the heartbeat
        (they would outlive the run otherwise) and destroy the process group."""
        from fullshard.launch.heartbeat import stop_heartbeat
        from fullshard.launch.subprocess_script import stop_watch_threads

        stop_heartbeat()
        stop_watch_threads()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

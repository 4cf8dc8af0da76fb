"""Where this process sits in the job: rank, local rank, node, world size, rendezvous address.

Three environments are recognised, in this order (as Lightning's connector does):

- `TorchElasticEnvironment`: started by `torchrun` / `fullshard run` (`TORCHELASTIC_RUN_ID`
  is set); `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `GROUP_RANK` are given.
- `SLURMEnvironment`: one task per rank started by `srun` (`SLURM_NTASKS` is set and the job is
  not an interactive shell); ranks come from `SLURM_PROCID` / `SLURM_LOCALID` /
  `SLURM_NODEID`, the rendezvous address from the first host of `SLURM_NODELIST` and the port
  from the job id (unless `MASTER_ADDR` / `MASTER_PORT` are set).
- `LocalEnvironment`: everything else -- a plain `python script.py` (whose launcher starts the
  other local ranks itself), or processes started by hand or by our launcher with
  `RANK` / `LOCAL_RANK` / `WORLD_SIZE` / `MASTER_ADDR` / `MASTER_PORT` / `NODE_RANK`.

An environment that `creates_processes_externally` already has every rank running; otherwise
the launcher (`fullshard.launch`) starts the local ranks. Nothing here talks to other
processes or initializes torch.distributed.
"""

from __future__ import annotations

import os
import re
import socket


class ClusterEnvironment:
    """The facts a strategy needs about the job; subclasses read them from the environment."""

    @staticmethod
    def detect() -> bool:
        raise NotImplementedError

    @property
    def creates_processes_externally(self) -> bool:
        """True when every rank was started by someone else (no launcher needed)."""
        raise NotImplementedError

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        return int(os.environ["MASTER_PORT"]) if "MASTER_PORT" in os.environ else 29500

    def world_size(self) -> int:
        raise NotImplementedError

    def global_rank(self) -> int:
        raise NotImplementedError

    def local_rank(self) -> int:
        raise NotImplementedError

    def node_rank(self) -> int:
        raise NotImplementedError

    def set_world_ranks(self, *, world_size: int, global_rank: int) -> None:
        """Environments that know the ranks themselves ignore this."""

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Raise `ValueError` when `devices * num_nodes` disagrees with what the job has."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _int_env(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        if default is None:
            raise ValueError(f"The environment variable {name} is required but not set.")
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"The environment variable {name}={value!r} is not an integer.") from None


def _check_product(kind: str, num_devices: int, num_nodes: int, world_size: int) -> None:
    if num_devices * num_nodes != world_size:
        raise ValueError(
            f"You set devices={num_devices} and num_nodes={num_nodes}, but {kind} started "
            f"{world_size} processes ({num_devices} * {num_nodes} != {world_size}). Make them "
            f"agree, or leave devices='auto' and num_nodes=1 to take the launcher's values."
        )


class _LauncherEnvironment(ClusterEnvironment):
    """Every rank started by a launcher that tells each its place in variables (`_VARIABLES`:
    world size, global rank, local rank, node rank)."""

    _VARIABLES: tuple[str, str, str, str]

    @property
    def creates_processes_externally(self) -> bool:
        return True

    def world_size(self) -> int:
        return _int_env(self._VARIABLES[0])

    def global_rank(self) -> int:
        return _int_env(self._VARIABLES[1])

    def local_rank(self) -> int:
        return _int_env(self._VARIABLES[2])

    def node_rank(self) -> int:
        return _int_env(self._VARIABLES[3], 0)


class TorchElasticEnvironment(_LauncherEnvironment):
    _VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "GROUP_RANK")

    @staticmethod
    def detect() -> bool:
        return "TORCHELASTIC_RUN_ID" in os.environ and all(
            k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")
        )

    def local_world_size(self) -> int:
        return _int_env("LOCAL_WORLD_SIZE", self.world_size())

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        _check_product("torchrun", num_devices, num_nodes, self.world_size())


_INTERACTIVE_JOB_NAMES = ("bash", "interactive", "sh", "zsh")


def first_slurm_host(nodelist: str) -> str:
    """The first hostname of a SLURM node list such as `gpu[003-005,010],cpu01`."""
    nodelist = nodelist.strip()
    match = re.match(r"([^,\[]+)(\[([^\]]*)\])?", nodelist)
    if not match:
        return "127.0.0.1"
    prefix, _, ranges = match.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return f"{prefix}{first}"


def _slurm_tasks_per_node() -> int | None:
    per_node = os.environ.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]  # e.g. "2(x4)"
    return int(per_node) if per_node.isdigit() else None


class SLURMEnvironment(_LauncherEnvironment):
    _VARIABLES = ("SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID")

    @staticmethod
    def detect() -> bool:
        if "SLURM_NTASKS" not in os.environ:
            return False
        return os.environ.get("SLURM_JOB_NAME", "") not in _INTERACTIVE_JOB_NAMES

    @property
    def main_address(self) -> str:
        if "MASTER_ADDR" in os.environ:
            return os.environ["MASTER_ADDR"]
        nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", "")
        return first_slurm_host(nodelist) if nodelist else "127.0.0.1"

    @property
    def main_port(self) -> int:
        if "MASTER_PORT" in os.environ:
            return int(os.environ["MASTER_PORT"])
        job_id = os.environ.get("SLURM_JOB_ID", "0")
        return 15000 + int(job_id[-4:]) if job_id[-4:].isdigit() else 29500

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        per_node = _slurm_tasks_per_node()
        if per_node is not None and per_node != num_devices:
            raise ValueError(
                f"You set devices={num_devices}, but SLURM runs {per_node} tasks per node "
                f"(--ntasks-per-node). Make them agree."
            )
        nnodes = os.environ.get("SLURM_NNODES") or os.environ.get("SLURM_JOB_NUM_NODES")
        if nnodes and nnodes.isdigit() and int(nnodes) != num_nodes:
            raise ValueError(
                f"You set num_nodes={num_nodes}, but the SLURM job has {nnodes} nodes "
                f"(--nodes). Make them agree."
            )
        _check_product("SLURM", num_devices, num_nodes, self.world_size())


class LocalEnvironment(ClusterEnvironment):
    """A plain process, a rank started by our launcher, or ranks set up by hand via env vars.

    `RANK`/`WORLD_SIZE` win when set; otherwise the strategy fills them in from
    `devices`/`num_nodes` (`set_world_ranks`), as Lightning's default environment does.
    """

    def __init__(self) -> None:
        self._world_size = _int_env("WORLD_SIZE", 1)
        self._global_rank = _int_env("RANK", 0)

    @staticmethod
    def detect() -> bool:
        return True

    @property
    def creates_processes_externally(self) -> bool:
        return "LOCAL_RANK" in os.environ

    @property
    def main_port(self) -> int:
        if "MASTER_PORT" in os.environ:
            return int(os.environ["MASTER_PORT"])
        port = free_port()
        os.environ["MASTER_PORT"] = str(port)  # children and later calls see the same port
        return port

    def world_size(self) -> int:
        return self._world_size

    def global_rank(self) -> int:
        return self._global_rank

    def local_rank(self) -> int:
        return _int_env("LOCAL_RANK", 0)

    def node_rank(self) -> int:
        return _int_env("NODE_RANK", _int_env("GROUP_RANK", 0))

    def set_world_ranks(self, *, world_size: int, global_rank: int) -> None:
        if "WORLD_SIZE" not in os.environ:
            self._world_size = world_size
        if "RANK" not in os.environ:
            self._global_rank = global_rank

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        if "WORLD_SIZE" in os.environ:
            _check_product("the environment (WORLD_SIZE)", num_devices, num_nodes,
                           self.world_size())


def detect_environment() -> ClusterEnvironment:
    """The environment this process runs in: torchelastic, SLURM, else local."""
    for cls in (TorchElasticEnvironment, SLURMEnvironment):
        if cls.detect():
            return cls()
    return LocalEnvironment()


def launched_world_size() -> int | None:
    """Processes per node given by a launcher or scheduler, or None for a plain process."""
    env = detect_environment()
    if isinstance(env, TorchElasticEnvironment):
        return env.local_world_size()
    if isinstance(env, SLURMEnvironment):
        per_node = _slurm_tasks_per_node()
        if per_node is not None:
            return per_node
        return max(1, env.world_size() // _int_env("SLURM_NNODES", 1))
    if "LOCAL_WORLD_SIZE" in os.environ:
        return _int_env("LOCAL_WORLD_SIZE")
    return None


def free_port() -> int:
    """A TCP port that is free on this machine right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])

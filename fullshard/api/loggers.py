"""Loggers for `Fabric(loggers=...)`: the protocol they follow and a CSV logger of our own.

A logger is any object with Lightning's logger methods -- `log_metrics(metrics, step=None)`,
`log_hyperparams(params)`, `save()`, `finalize(status)` -- so Lightning's own loggers
(`CSVLogger`, `TensorBoardLogger`, ...) work unchanged when Lightning is installed, and
`fullshard.CSVLogger` needs nothing. `fabric.log` / `fabric.log_dict` turn one-element tensors
into Python numbers first and call every logger on every rank; as in Lightning, the loggers
themselves write on global rank 0 only.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

_REQUIRED = ("log_metrics", "log_hyperparams", "save", "finalize")


def check_loggers(loggers: object) -> list[Any]:
    """`Fabric(loggers=...)` as a list, each entry checked to follow the logger protocol."""
    if loggers is None:
        return []
    items = list(loggers) if isinstance(loggers, list | tuple) else [loggers]
    for logger in items:
        missing = [m for m in _REQUIRED if not callable(getattr(logger, m, None))]
        if missing:
            raise TypeError(
                f"Fabric(loggers=...) got {type(logger).__name__}, which lacks "
                f"{', '.join(missing)}: a logger needs Lightning's logger methods "
                f"({', '.join(_REQUIRED)}). Use fullshard.CSVLogger or one of Lightning's."
            )
    return items


def to_scalars(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """`metrics` with every tensor replaced by its Python number (detached)."""
    if not isinstance(metrics, Mapping):
        raise TypeError(f"log_dict(metrics=...) takes a mapping of names to values, got "
                        f"{type(metrics).__name__}")
    out: dict[str, Any] = {}
    for name, value in metrics.items():
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"The metric {name!r} is a tensor of shape {tuple(value.shape)}; a logged "
                    f"value must be a single number (reduce it, e.g. .mean(), first)."
                )
            value = value.detach().item()
        out[name] = value
    return out


def _global_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class CSVLogger:
    """Write metrics to `root_dir/name/version_N/metrics.csv` (one row per `log_metrics` call)
    and hyperparameters to `hparams.json` beside it, on global rank 0 only.

    Rows are appended as they are logged, so nothing is lost if the script dies; when a new
    metric name appears the file is rewritten with the wider header (earlier rows get empty
    cells). `version=None` takes the next free `version_N` on first use.

    Args:
        root_dir: the directory for all runs.
        name: a subdirectory per experiment ('' for none).
        version: an int (`version_N`), a string (used as is), or None.
    """

    def __init__(self, root_dir: str | os.PathLike, name: str = "lightning_logs",
                 version: int | str | None = None) -> None:
        if not isinstance(name, str):
            raise TypeError(f"CSVLogger(name=...) must be a string, got {name!r}")
        if version is not None and not isinstance(version, int | str):
            raise TypeError(f"CSVLogger(version=...) must be an int, a string or None, got "
                            f"{version!r}")
        self._root_dir = Path(os.fspath(root_dir))
        self._name = name
        self._version = version
        self._keys: list[str] = []
        self._rows: list[dict[str, Any]] = []

    @property
    def name(self) -> str:
        return self._name

    @property
    def root_dir(self) -> str:
        return str(self._root_dir / self._name)

    @property
    def version(self) -> int | str:
        if self._version is None:
            base = Path(self.root_dir)
            taken = [int(p.name.split("_", 1)[1]) for p in base.glob("version_*")
                     if p.is_dir() and p.name.split("_", 1)[1].isdigit()] if base.is_dir() else []
            self._version = max(taken, default=-1) + 1
        return self._version

    @property
    def log_dir(self) -> str:
        version = self.version
        folder = f"version_{version}" if isinstance(version, int) else version
        return str(Path(self.root_dir) / folder)

    @property
    def metrics_file(self) -> Path:
        return Path(self.log_dir) / "metrics.csv"

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        if _global_rank() != 0:
            return
        row = dict(to_scalars(metrics))
        row["step"] = step if step is not None else len(self._rows)
        self._rows.append(row)
        new = [k for k in row if k not in self._keys]
        path = self.metrics_file
        path.parent.mkdir(parents=True, exist_ok=True)
        if new or not path.exists():
            self._keys.extend(new)
            with path.open("w", newline="") as f:  # the header grew: rewrite every row
                writer = csv.DictWriter(f, fieldnames=self._keys)
                writer.writeheader()
                writer.writerows(self._rows)
        else:
            with path.open("a", newline="") as f:
                csv.DictWriter(f, fieldnames=self._keys).writerow(row)

    def log_hyperparams(self, params: Mapping[str, Any] | Any, *args: Any,
                        **kwargs: Any) -> None:
        if _global_rank() != 0:
            return
        if not isinstance(params, Mapping):
            params = vars(params)  # an argparse.Namespace or a plain object
        path = Path(self.log_dir) / "hparams.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dict(params), indent=2, default=repr) + "\n")

    def save(self) -> None:
        """Nothing buffered: rows are written as they are logged."""

    def finalize(self, status: str) -> None:
        self.save()

    def __repr__(self) -> str:
        return f"CSVLogger(root_dir={str(self._root_dir)!r}, name={self._name!r})"


def read_metrics(path: str | os.PathLike) -> list[dict[str, float | int | None]]:
    """The rows of a `metrics.csv` (ours or Lightning's) as dicts of numbers (None if empty)."""

    def number(text: str) -> float | int | None:
        if text == "":
            return None
        try:
            return int(text)
        except ValueError:
            return float(text)

    with Path(path).open(newline="") as f:
        return [{k: number(v) for k, v in row.items()} for row in csv.DictReader(f)]

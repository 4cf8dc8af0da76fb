"""Loading a checkpoint never runs code from it unless the user opts in (issue 15), in one
process (no ranks needed: every format loads into a plain module without a process group).

A planted payload -- an object whose unpickling calls `_touch`, which creates a marker file --
sits in each kind of file a load reads: a full checkpoint, a sharded checkpoint's `meta.pt`,
DCP's `.metadata` index, a DCP byte item (an optimizer param group), the input of
`fullshard consolidate`, and a bare state dict loaded into a module (`load_raw`). By default
the marker is never created and the error names what was found, where, and how to opt in;
`weights_only=False` / `--unsafe-load` loads files that need it.
"""

from __future__ import annotations

import pickle
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from fullshard.checkpoint import (
    UnsafeCheckpointError,
    consolidate,
    load_checkpoint,
    save_checkpoint,
    to_full,
)
from fullshard.checkpoint.integrity import SUMS
from fullshard.cli import main as cli_main


def _touch(path: str) -> str:
    Path(path).write_text("the payload ran")
    return "payload ran"


class Payload:
    """Unpickling this calls `_touch(marker)`: code from the file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (_touch, (self.marker,))


@dataclass
class Point:
    """A harmless class `weights_only=True` still refuses: loading it needs the opt-in."""

    x: int
    y: int


class Versioned(nn.ReLU):
    """A module with extra state (a non-tensor state-dict entry, a DCP byte item)."""

    def __init__(self) -> None:
        super().__init__()
        self.info = {"version": 1, "names": ["a"]}

    def get_extra_state(self) -> dict:
        return self.info

    def set_extra_state(self, state: dict) -> None:
        self.info = state


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), Versioned(), nn.Linear(3, 2))


def _state(model: nn.Module) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    return {"model": model, "optimizer": opt, "scheduler": sched, "step": 3}


def _fresh() -> dict:
    return _state(_model())


def _refused(marker: Path, call, *names: str) -> str:
    with pytest.raises(UnsafeCheckpointError) as info:
        call()
    assert not marker.exists(), "the payload ran on a default load"
    text = str(info.value)
    for name in ("weights_only=False", "Only for files you trust", *names):
        assert name in text, (name, text)
    return text


def _plant_torch_file(file: Path, marker: Path, where: str) -> None:
    data = torch.load(file, weights_only=True)
    data[where] = {"list": [1, Payload(marker)]}
    torch.save(data, file)


def test_full_file_payload_never_runs(tmp_path) -> None:
    path, marker = tmp_path / "full.pt", tmp_path / "ran"
    save_checkpoint(path, _state(_model()), state_dict_type="full")
    _plant_torch_file(path, marker, "note")
    text = _refused(marker, lambda: load_checkpoint(path, _fresh()), "_touch",
                    "ckpt['note']['list'][1]", str(path))
    assert "full checkpoint file" in text
    _refused(marker, lambda: load_checkpoint(path, _fresh(), weights_only=None), "_touch")
    _refused(marker, lambda: load_checkpoint(path), "_touch")  # state=None: the raw dict
    rest = load_checkpoint(path, _fresh(), weights_only=False)  # the opt-in
    assert marker.exists() and rest["note"] == {"list": [1, "payload ran"]}


def test_sharded_meta_payload_never_runs(tmp_path) -> None:
    path, marker = tmp_path / "sharded", tmp_path / "ran"
    save_checkpoint(path, _state(_model()))
    _plant_torch_file(path / "meta.pt", marker, "evil")
    (path / SUMS).unlink()  # an attacker drops the checksums that would give the edit away
    _refused(marker, lambda: load_checkpoint(path, _fresh()), "_touch", "['evil']", "meta.pt")
    _refused(marker, lambda: load_checkpoint(path, _model()), "_touch")  # load_raw(module)
    _refused(marker, lambda: to_full(path), "_touch")
    out = tmp_path / "c.pt"
    _refused(marker, lambda: consolidate(path, out), "_touch")
    assert cli_main(["consolidate", str(path), str(out)]) == 1
    assert not marker.exists() and not out.exists()
    assert cli_main(["consolidate", "--unsafe-load", str(path), str(out)]) == 0  # the opt-in
    assert marker.exists() and out.exists()


def test_dcp_index_and_byte_item_payloads_never_run(tmp_path) -> None:
    marker = tmp_path / "ran"
    # DCP's .metadata: plain pickle for DCP itself.
    path = tmp_path / "index"
    save_checkpoint(path, _state(_model()))
    index_file = path / ".metadata"
    index = pickle.loads(index_file.read_bytes())  # our own file, written just now
    index.planner_data["evil"] = Payload(marker)
    index_file.write_bytes(pickle.dumps(index))
    (path / SUMS).unlink()
    _refused(marker, lambda: load_checkpoint(path, _fresh()), "_touch", ".metadata")
    _refused(marker, lambda: to_full(path), "_touch")
    load_checkpoint(path, _fresh(), weights_only=False)
    assert marker.exists()
    marker.unlink()

    # A DCP byte item: the optimizer's param groups are stored as pickled values.
    path = tmp_path / "bytes"
    state = _state(_model())
    state["optimizer"].param_groups[0]["evil"] = Payload(marker)
    save_checkpoint(path, state)
    assert not marker.exists()
    _refused(marker, lambda: load_checkpoint(path, _fresh()), "_touch",
             "'optimizer.param_groups.0.evil'")
    _refused(marker, lambda: to_full(path), "_touch")
    fresh = _fresh()
    load_checkpoint(path, fresh, weights_only=False)
    assert marker.exists() and fresh["optimizer"].param_groups[0]["evil"] == "payload ran"


def test_load_raw_bare_state_dict_payload_never_runs(tmp_path) -> None:
    path, marker = tmp_path / "weights.pt", tmp_path / "ran"
    sd = dict(_model().state_dict())
    sd["_extra"] = Payload(marker)
    torch.save(sd, path)
    _refused(marker, lambda: load_checkpoint(path, _model()), "_touch", "ckpt['_extra']")


def test_opt_in_loads_objects_that_need_it(tmp_path) -> None:
    for fmt in ("full", "sharded"):
        path = tmp_path / fmt
        state = _state(_model())
        state["point"] = Point(1, 2)
        save_checkpoint(path, state, state_dict_type=fmt)
        text = _refused(tmp_path / "never", lambda p=path: load_checkpoint(p, _fresh()), "Point",
                        "['point']")
        assert "fullshard's own checkpoints hold only tensors" in text
        rest = load_checkpoint(path, _fresh(), weights_only=False)
        assert rest["point"] == Point(1, 2)
    with pytest.raises(TypeError, match="weights_only must be True, False or None"):
        load_checkpoint(tmp_path / "full", _fresh(), weights_only="no")  # type: ignore[arg-type]


def test_what_fullshard_writes_loads_under_the_default(tmp_path) -> None:
    """Model, optimizer, scheduler, RNG states (torch and Python's `random`) and user scalars,
    both formats, load with the default and with plain `torch.load(weights_only=True)`."""
    for fmt in ("full", "sharded"):
        path = tmp_path / fmt
        state = _state(_model())
        state["model"][1].info = {"version": 2, "names": ["b", "c"], "scale": 0.5}
        state.update(rng={"torch": torch.get_rng_state(), "python": random.getstate()},
                     lr=0.5, name="run-1", shape=torch.Size([2, 3]), flags=(True, None),
                     losses=[1.0, 0.5])
        save_checkpoint(path, state, state_dict_type=fmt)
        raw = torch.load(path if fmt == "full" else path / "meta.pt", weights_only=True)
        assert raw["rng"]["python"] == state["rng"]["python"] and raw["lr"] == 0.5
        fresh = {**_fresh(), "step": 0, "rng": None, "shape": None}
        rest = load_checkpoint(path, fresh)
        assert fresh["step"] == 3 and fresh["shape"] == torch.Size([2, 3])
        assert torch.equal(fresh["rng"]["torch"], state["rng"]["torch"])
        assert fresh["rng"]["python"] == state["rng"]["python"]
        for a, b in zip(state["model"].parameters(), fresh["model"].parameters()):
            assert torch.equal(a, b)
        for a, b in zip(state["model"].parameters(), fresh["model"].parameters()):
            for k, v in state["optimizer"].state[a].items():
                assert torch.equal(v, fresh["optimizer"].state[b][k]), k
        assert fresh["scheduler"].state_dict() == state["scheduler"].state_dict()
        assert fresh["model"][1].info == {"version": 2, "names": ["b", "c"], "scale": 0.5}
        assert rest == {"lr": 0.5, "name": "run-1", "flags": (True, None),
                        "losses": [1.0, 0.5]}


# -- issue 25: concurrent saves, bad calls -------------------------------------------------------
@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_concurrent_saves_to_one_path_never_delete_each_others_work(tmp_path, monkeypatch,
                                                                    fmt) -> None:
    """Save A is paused in the middle of writing its temporary file or directory while save
    B, to the same path, runs from start to end (its start removes crashed saves' leftovers):
    A's work survives and A completes; the last rename wins."""
    import threading

    real_save = torch.save
    started, go = threading.Event(), threading.Event()

    def paused_save(obj, f, *args, **kwargs):  # type: ignore[no-untyped-def]
        if threading.current_thread().name == "save-A" and not started.is_set():
            started.set()
            go.wait(30)
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", paused_save)
    path = tmp_path / "ckpt"
    a, b = nn.Linear(4, 3), nn.Linear(4, 3)
    errors: list[BaseException] = []

    def save_a() -> None:
        try:
            save_checkpoint(path, {"model": a}, state_dict_type=fmt)
        except BaseException as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    thread = threading.Thread(target=save_a, name="save-A")
    thread.start()
    assert started.wait(30)
    save_checkpoint(path, {"model": b}, state_dict_type=fmt)  # B, while A is mid-write
    go.set()
    thread.join(60)
    assert errors == []
    loaded = nn.Linear(4, 3)
    load_checkpoint(path, {"model": loaded})
    assert torch.equal(loaded.weight, a.weight)  # A renamed last
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


@pytest.mark.parametrize("bad", ["notadict", None, [("weight", torch.zeros(2))], [1, 2]])
def test_load_full_state_dict_rejects_what_is_not_a_state_dict(world1, bad) -> None:
    import fullshard

    model = fullshard.fsdp(nn.Linear(4, 2), device="cpu")
    with pytest.raises(TypeError, match=r"load_full_state_dict\(model, state_dict\): "
                                        r"state_dict must be a dict .* got "):
        fullshard.load_full_state_dict(model, bad)
    with pytest.raises(TypeError, match=r"state_dict\['weight'\] must be a tensor; got str"):
        fullshard.load_full_state_dict(model, {"weight": "x", "bias": torch.zeros(2)})


def test_process_exit_waits_for_an_async_save(tmp_path) -> None:
    """A script that ends right after `save_checkpoint(async_save=True)` still leaves the
    complete checkpoint: exit waits for the background write."""
    import subprocess
    import sys

    script = (
        "import torch, time\n"
        "from torch.distributed.checkpoint import FileSystemWriter\n"
        "from fullshard.checkpoint import save_checkpoint\n"
        "write = FileSystemWriter.write_data\n"
        "def slow(self, plan, planner):\n"
        "    time.sleep(1.0)\n"  # the write is certainly still running when the script ends
        "    return write(self, plan, planner)\n"
        "FileSystemWriter.write_data = slow\n"
        "torch.manual_seed(0)\n"
        f"save_checkpoint({str(tmp_path / 'ckpt')!r}, {{'model': torch.nn.Linear(8, 4)}},\n"
        "                async_save=True)\n"
    )
    env = {**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    torch.manual_seed(0)
    expected, loaded = nn.Linear(8, 4), nn.Linear(8, 4)
    nn.init.zeros_(loaded.weight)
    load_checkpoint(tmp_path / "ckpt", {"model": loaded})
    assert torch.equal(loaded.weight, expected.weight)

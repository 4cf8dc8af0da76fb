"""Nothing lost (issue 4, acceptance 4): SIGKILL the ranks in the middle of saves -- a rank
dying before its shard file, a kill right after the first rank's file, after every file but
before the rename, between the two renames of a replace, in the middle of a full file -- and
check each time that another checkpoint is untouched and that the target path is either absent
or loads completely (the previous or the new checkpoint, never a mix). Then truncated and
missing files fail to load with an error naming the file."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

import fullshard
from fullshard.checkpoint import CheckpointError, atomic, load_checkpoint
from fullshard.testing import DistributedGroup, RankFailure
from fullshard.testing.models import TinyGPT
from tests.distributed import ckpt_common as cc


@pytest.fixture(scope="module")
def group2():
    with DistributedGroup(2, grace=2.0) as g:
        yield g


def _model_at(steps: int, s):
    model, opt, sched = cc.build("gpt", s)
    cc.train(model, opt, sched, steps)
    return model, opt, sched


def _save_two(root: str) -> dict:
    """`other` and `target` hold the 1-step model; returns the 1- and 2-step weights."""
    s = cc.strategy()
    model, opt, sched = _model_at(1, s)
    state = {"model": model, "optimizer": opt}
    s.save_checkpoint(f"{root}/other", state)
    s.save_checkpoint(f"{root}/target", state)
    cc.strategy(state_dict_type="full").save_checkpoint(f"{root}/target.pt", state)
    old = fullshard.full_state_dict(model)
    cc.train(model, opt, sched, 1)
    return {"old": old, "new": fullshard.full_state_dict(model)}


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _save_and_die(root: str, when: str) -> None:
    """Save the 2-step model over `target` (sharded, or `target.pt` full) and SIGKILL the
    ranks at `when`, by patching the step that comes next."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    rank = dist.get_rank()
    s = cc.strategy(state_dict_type="full" if when == "full-mid-file" else "sharded")
    model, opt, _ = _model_at(2, s)
    write_data = FileSystemWriter.write_data

    def writer(self, plan, planner):  # type: ignore[no-untyped-def]
        if when == "rank1-before-its-file" and rank == 1:
            _die()
        fut = write_data(self, plan, planner)
        fut.wait()
        if when == "after-rank0-file" and rank == 0:
            _die()
        return fut

    FileSystemWriter.write_data = writer
    if when == "before-rename" and rank == 0:
        atomic.commit = lambda *a: _die()
    if when == "between-renames" and rank == 0:
        atomic._exchange = lambda a, b: False  # the fallback: rename aside, then into place
        rename = os.rename

        def rename_then_die(a, b):  # type: ignore[no-untyped-def]
            rename(a, b)
            if atomic.OLD_TAG in str(b):
                _die()

        atomic.os.rename = rename_then_die
    if when == "full-mid-file" and rank == 0:
        def half_then_die(obj, path):  # type: ignore[no-untyped-def]
            with open(path, "wb") as f:
                f.write(b"PK\x03\x04" + b"\0" * 4096)
            _die()

        atomic.save_file = half_then_die
    target = "target.pt" if when == "full-mid-file" else "target"
    s.save_checkpoint(f"{root}/{target}", {"model": model, "optimizer": opt})


def _weights(path: Path) -> dict:
    model = TinyGPT(layers=2)
    load_checkpoint(path, {"model": model}, strict=True)
    return model.state_dict()


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(v, b[k]) for k, v in a.items())


WHEN = ("rank1-before-its-file", "after-rank0-file", "before-rename", "between-renames",
        "full-mid-file")


def test_sigkill_during_save_loses_nothing(group2: DistributedGroup, tmp_path) -> None:
    weights = group2.run(_save_two, str(tmp_path))[0]
    for when in WHEN:
        with pytest.raises(RankFailure, match="SIGKILL"):
            group2.run(_save_and_die, str(tmp_path), when, timeout=60)
        assert _same(_weights(tmp_path / "other"), weights["old"]), when
        for target in (tmp_path / "target", tmp_path / "target.pt"):
            if when == "between-renames" and target.name == "target":
                # The only window without a target: the previous checkpoint is intact aside,
                # and loading the target says where it is.
                assert not target.exists()
                with pytest.raises(FileNotFoundError, match="interrupted while replacing"):
                    _weights(target)
                (aside,) = atomic.aside_copies(target)
                assert _same(_weights(aside), weights["old"])
                aside.rename(target)  # what the message says to do
                continue
            assert _same(_weights(target), weights["old"]), (when, target)
    # No crash this time: the new checkpoint replaces the old, leftovers are cleaned up.
    group2.run(_save_and_die, str(tmp_path), "never")
    assert _same(_weights(tmp_path / "target"), weights["new"])
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".target.fullshard")] == []


def test_truncated_or_missing_files_name_the_file(group2: DistributedGroup, tmp_path) -> None:
    group2.run(_save_two, str(tmp_path))
    good = tmp_path / "target"

    def broken(name: str, how: str) -> Path:
        bad = tmp_path / f"bad-{name}-{how}"
        shutil.copytree(good, bad)
        if how == "missing":
            (bad / name).unlink()
        else:
            size = (bad / name).stat().st_size
            os.truncate(bad / name, size // 2)
        return bad

    for name in ("__1_0.distcp", "__0_0.distcp", ".metadata"):
        for how in ("missing", "truncated"):
            with pytest.raises(CheckpointError, match=f"{name}.*(truncated|missing)|"
                                                      f"missing its file.*{name}"):
                _weights(broken(name, how))
    with pytest.raises(CheckpointError, match="meta.pt.*truncated or corrupt"):
        _weights(broken("meta.pt", "truncated"))
    full = tmp_path / "target.pt"
    os.truncate(full, full.stat().st_size - 100)
    with pytest.raises(RuntimeError, match="target.pt.*truncated or corrupt"):
        _weights(full)

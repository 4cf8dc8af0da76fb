"""Fabric's API pieces that need no process group: batches moved with their types, samplers
kept and sharded as Lightning shards them, seeding, loggers, callbacks, plugins, and the
precision object Lightning's utilities accept (compared with Lightning where importable)."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import random
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    RandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

import fullshard
from fullshard import Fabric
from fullshard.api.batches import cast_floating, move_to_device
from fullshard.api.connector import resolve_plugins
from fullshard.api.data import DistributedSamplerWrapper, distributed_sampler
from fullshard.api.forward_methods import attach, mark_forward_method
from fullshard.api.loggers import CSVLogger, check_loggers, read_metrics, to_scalars
from fullshard.api.precision import Precision
from fullshard.api.seed import _seed_sequence, seed_everything

META = torch.device("meta")


# -- batches ----------------------------------------------------------------------------------
class Pair(typing.NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class Batch:
    ids: torch.Tensor
    extra: dict
    name: str = "b"


@dataclasses.dataclass(frozen=True)
class Frozen:
    ids: torch.Tensor


class Movable:
    """Moves itself, like a transformers BatchEncoding."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def to(self, device):  # noqa: ANN001
        return Movable(self.t.to(device))


def test_every_container_is_moved_and_keeps_its_type() -> None:
    t = torch.ones(2)
    dd = collections.defaultdict(list, {"a": t})
    batch = {
        "dict": {"t": t},
        "ordered": collections.OrderedDict(t=t),
        "default": dd,
        "user": collections.UserDict({"t": t}),
        "pair": Pair(t, t),
        "data": Batch(ids=t, extra={"m": t}),
        "frozen": Frozen(ids=t),
        "list": [t, (t, 3)],
        "movable": Movable(t),
        "text": "left alone",
    }
    out = move_to_device(batch, META)
    assert type(out["ordered"]) is collections.OrderedDict
    assert type(out["default"]) is collections.defaultdict
    assert out["default"].default_factory is list
    assert type(out["user"]) is collections.UserDict
    assert type(out["pair"]) is Pair and type(out["data"]) is Batch
    assert type(out["frozen"]) is Frozen and type(out["movable"]) is Movable
    assert out["data"].name == "b" and out["text"] == "left alone"
    assert out["list"][1][1] == 3 and type(out["list"][1]) is tuple
    leaves = [out["dict"]["t"], out["ordered"]["t"], out["default"]["a"], out["user"]["t"],
              out["pair"].x, out["data"].ids, out["data"].extra["m"], out["frozen"].ids,
              out["list"][0], out["list"][1][0], out["movable"].t]
    assert all(x.device == META for x in leaves)
    # The original batch is untouched.
    assert batch["data"].ids.device.type == "cpu" and batch["default"]["a"].device.type == "cpu"


def test_transformers_batch_encoding_is_moved_as_itself() -> None:
    transformers = pytest.importorskip("transformers")
    enc = transformers.BatchEncoding({"input_ids": torch.ones(2, 3, dtype=torch.long)})
    out = move_to_device({"enc": enc}, META)
    assert type(out["enc"]) is transformers.BatchEncoding
    assert out["enc"]["input_ids"].device == META
    cast = cast_floating(transformers.BatchEncoding({"x": torch.ones(2)}), torch.bfloat16)
    assert type(cast) is transformers.BatchEncoding and cast["x"].dtype == torch.bfloat16


def test_precision_casts_dataclass_inputs() -> None:
    out = cast_floating(Batch(ids=torch.ones(2), extra={"i": torch.ones(2, dtype=torch.long)}),
                        torch.bfloat16)
    assert out.ids.dtype == torch.bfloat16 and out.extra["i"].dtype == torch.long


# -- samplers ---------------------------------------------------------------------------------
def _weighted(seed: int) -> WeightedRandomSampler:
    weights = torch.arange(1, 12, dtype=torch.double)
    return WeightedRandomSampler(weights, num_samples=11,
                                 generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shuffle,drop_last", [(False, False), (True, False), (False, True)])
def test_sampler_wrapper_gives_lightnings_slices(shuffle: bool, drop_last: bool) -> None:
    lightning = pytest.importorskip("lightning.fabric.utilities.distributed")
    for rank in (0, 1, 2):
        ours = DistributedSamplerWrapper(_weighted(5), num_replicas=3, rank=rank,
                                         shuffle=shuffle, seed=7, drop_last=drop_last)
        theirs = lightning.DistributedSamplerWrapper(_weighted(5), num_replicas=3, rank=rank,
                                                     shuffle=shuffle, seed=7,
                                                     drop_last=drop_last)
        for epoch in range(3):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)
        assert len(ours) == len(theirs)


def test_sampler_wrapper_splits_one_draw_across_ranks() -> None:
    draws = [list(DistributedSamplerWrapper(_weighted(3), num_replicas=2, rank=r)) for r in (0, 1)]
    whole = list(_weighted(3))
    padded = whole + whole[:1]  # 11 indices over 2 ranks: padded to 12 as DistributedSampler
    assert draws[0] == padded[0::2] and draws[1] == padded[1::2]


def test_setup_keeps_a_custom_sampler_and_replaces_the_default_ones() -> None:
    data = TensorDataset(torch.arange(11.0))
    kept = distributed_sampler(DataLoader(data, sampler=_weighted(0)), 2, 1)
    assert isinstance(kept, DistributedSamplerWrapper) and isinstance(kept.sampler,
                                                                      WeightedRandomSampler)
    plain = distributed_sampler(DataLoader(data, shuffle=True), 2, 1)
    assert type(plain) is DistributedSampler and plain.shuffle
    assert distributed_sampler(DataLoader(data, sampler=plain), 2, 1) is None
    assert not distributed_sampler(DataLoader(data), 2, 0).shuffle
    assert isinstance(DataLoader(data, shuffle=True).sampler, RandomSampler)

    class Endless(torch.utils.data.Sampler):
        def __iter__(self):
            yield from range(3)

    with pytest.raises(TypeError, match="has no __len__.*use_distributed_sampler=False"):
        distributed_sampler(DataLoader(data, sampler=Endless()), 2, 0)


# -- seeding ----------------------------------------------------------------------------------
def _draw() -> tuple:
    np = pytest.importorskip("numpy")
    return (torch.rand(3).tolist(), random.random(), float(np.random.rand()))


def test_seed_everything_has_lightnings_effect(monkeypatch: pytest.MonkeyPatch) -> None:
    seed_mod = pytest.importorskip("lightning.fabric.utilities.seed")
    for var in ("PL_GLOBAL_SEED", "FULLSHARD_GLOBAL_SEED", "PL_SEED_WORKERS"):
        monkeypatch.delenv(var, raising=False)
    assert seed_everything(123, verbose=False) == 123
    ours = _draw()
    seed_mod.seed_everything(123, verbose=False)
    assert _draw() == ours
    assert os.environ["PL_GLOBAL_SEED"] == "123" and os.environ["PL_SEED_WORKERS"] == "0"
    # Fabric's static method seeds workers by default, as Lightning's Fabric does.
    assert Fabric.seed_everything(5, verbose=False) == 5
    assert os.environ["FULLSHARD_SEED_WORKERS"] == "1" and os.environ["PL_SEED_WORKERS"] == "1"
    monkeypatch.delenv("PL_GLOBAL_SEED")
    monkeypatch.delenv("FULLSHARD_GLOBAL_SEED")
    assert seed_everything(verbose=False) == 0
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*32\)"):
        seed_everything(-1)


def test_worker_seeds_differ_per_worker_and_rank_and_repeat() -> None:
    seeds = {tuple(_seed_sequence(7, w, r, 4)) for w in range(4) for r in range(4)}
    assert len(seeds) == 16
    assert _seed_sequence(7, 1, 1, 4) == _seed_sequence(7, 1, 1, 4)


# -- loggers and callbacks --------------------------------------------------------------------
def test_csv_logger_through_fabric_log(tmp_path: Path) -> None:
    ours = CSVLogger(tmp_path, name="run")
    fabric = Fabric(accelerator="cpu", devices=1, loggers=ours)
    assert fabric.logger is ours and fabric.loggers == [ours]
    fabric.log("loss", torch.tensor(2.5), step=0)
    fabric.log_dict({"loss": 1.5, "lr": torch.tensor([0.1], dtype=torch.float64)}, step=1)
    ours.log_hyperparams({"lr": 0.1})
    ours.finalize("success")
    rows = read_metrics(ours.metrics_file)
    assert ours.metrics_file == tmp_path / "run" / "version_0" / "metrics.csv"
    assert rows == [{"loss": 2.5, "step": 0, "lr": None}, {"loss": 1.5, "step": 1, "lr": 0.1}]
    assert json.loads((tmp_path / "run" / "version_0" / "hparams.json").read_text()) == {
        "lr": 0.1}
    assert CSVLogger(tmp_path, name="run").version == 1
    with pytest.raises(ValueError, match="shape.*single number"):
        to_scalars({"v": torch.ones(2)})
    with pytest.raises(TypeError, match="lacks log_metrics.*fullshard.CSVLogger"):
        check_loggers([object()])
    with pytest.raises(IndexError, match="no loggers"):
        _ = Fabric(accelerator="cpu", devices=1).logger


def test_csv_logger_writes_on_rank_zero_only(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    logger = CSVLogger(tmp_path)
    logger.log_metrics({"a": 1.0})
    logger.log_hyperparams({"a": 1})
    assert not any(tmp_path.iterdir())


def test_lightning_loggers_work_through_fabric(tmp_path: Path) -> None:
    loggers = pytest.importorskip("lightning.fabric.loggers")
    theirs = loggers.CSVLogger(tmp_path, name="theirs")
    ours = CSVLogger(tmp_path, name="ours")
    fabric = Fabric(accelerator="cpu", devices=1, loggers=[theirs, ours])
    for step in range(3):
        fabric.log_dict({"loss": torch.tensor(1.0 / (step + 1)), "tokens": 8 * step}, step=step)
    theirs.finalize("success")
    got = read_metrics(Path(theirs.log_dir) / "metrics.csv")
    assert got == read_metrics(ours.metrics_file)


def test_call_passes_the_keywords_each_callback_takes() -> None:
    seen = []

    class A:
        def on_epoch_end(self, epoch, loss=None):
            seen.append(("A", epoch, loss))

    class B:
        def on_epoch_end(self, epoch, **kwargs):
            seen.append(("B", epoch, kwargs))

    class C:
        pass

    fabric = Fabric(accelerator="cpu", devices=1, callbacks=[A(), B(), C()])
    fabric.call("on_epoch_end", 3, loss=0.5, other=1)
    assert seen == [("A", 3, 0.5), ("B", 3, {"loss": 0.5, "other": 1})]
    Fabric(accelerator="cpu", devices=1, callbacks=A()).call("on_epoch_end", epoch=1)
    assert seen[-1] == ("A", 1, None)


# -- plugins and the precision object -----------------------------------------------------------
def test_precision_plugins_are_accepted() -> None:
    fabric = Fabric(accelerator="cpu", devices=1, plugins=Precision("bf16-mixed"))
    assert fabric.strategy.precision == "bf16-mixed"
    assert fabric.strategy.precision == "bf16" and fabric.strategy.precision != "32-true"
    assert Fabric(accelerator="cpu", devices=1, plugins=["16-true"]).strategy.precision == (
        "16-true")
    with pytest.raises(ValueError, match="set it in one place"):
        Fabric(accelerator="cpu", devices=1, precision="bf16-mixed", plugins="16-true")
    with pytest.raises(ValueError, match="two precision plugins"):
        resolve_plugins(["bf16-mixed", Precision()])
    with pytest.raises(TypeError, match="does not support"):
        resolve_plugins([object()])


def test_lightning_precision_plugins_and_throughput_dtype() -> None:
    plugins = pytest.importorskip("lightning.fabric.plugins")
    throughput = pytest.importorskip("lightning.fabric.utilities.throughput")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=plugins.HalfPrecision("bf16-true"))
    assert fabric.strategy.precision == "bf16-true"
    with pytest.raises(TypeError, match="cannot honour"):
        resolve_plugins(plugins.DoublePrecision())
    for name in ("32-true", "bf16-mixed", "16-true", "bf16-true"):
        ours = Fabric(accelerator="cpu", devices=1, precision=name).strategy.precision
        assert isinstance(ours, plugins.Precision) and isinstance(ours, Precision)
        # The compute dtype Lightning derives equals the one of its own FSDP plugin.
        assert throughput._plugin_to_compute_dtype(ours) == (
            throughput._plugin_to_compute_dtype(plugins.FSDPPrecision(name)))
        assert ours.forward_context().__class__ is Precision(name).forward_context().__class__


def test_fullshard_never_imports_lightning() -> None:
    code = (
        "import sys, fullshard\n"
        "f = fullshard.Fabric(accelerator='cpu', devices=1, precision='bf16-mixed')\n"
        "p = f.strategy.precision\n"
        "assert type(p).__mro__[1] is object, type(p).__mro__\n"
        "assert not any(m.startswith(('lightning', 'pytorch_lightning')) for m in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr


# -- model.module and mark_forward_method (on a plain module; sharded: distributed test) -------
class WithGenerate(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def forward(self, x):
        return self.lin(x)

    def generate(self, x, times=2):
        for _ in range(times):
            x = self.forward(x)  # a marked method may call forward itself
        return x


def test_mark_forward_method_routes_through_the_forward_hooks() -> None:
    model = WithGenerate()
    attach(model)
    view = model.module
    assert type(view) is WithGenerate and isinstance(model, WithGenerate)
    assert view.lin is model.lin and "module" not in dict(model.named_modules())
    view.extra = 3  # one state: written through the view, read on the model
    assert model.extra == 3
    assert torch.equal(view(torch.ones(1, 2)), model(torch.ones(1, 2)))

    def unwrap(m):  # transformers' / timm's unwrap_model: must stop, not recurse forever
        return unwrap(m.module) if hasattr(m, "module") else m

    assert type(unwrap(model)) is WithGenerate
    calls = []
    model.register_forward_pre_hook(lambda m, a: calls.append(a[0].shape))
    x = torch.ones(1, 2)
    expected = model.lin(model.lin(x))
    model.generate(x)
    assert calls == []  # an unmarked method bypasses the root's hooks
    model.mark_forward_method("generate")
    out = model.generate(x, times=2)
    assert calls == [(1, 2)] and torch.equal(out, expected)
    assert "forward" not in model.__dict__  # restored after the call
    with pytest.raises(ValueError, match="mark other methods"):
        mark_forward_method(model, "forward")
    with pytest.raises(AttributeError, match="no method 'nope'"):
        mark_forward_method(model, "nope")
    assert fullshard.CSVLogger is CSVLogger


def test_mark_forward_method_keeps_an_instance_forward() -> None:
    # A compiled model's sharded root runs an instance `forward` (api/compile_units.py, the
    # root's frame eager): a marked method's call leaves it in place, and the method's own
    # `self.forward` calls reach it.
    model = WithGenerate()
    attach(model)
    seen = []

    def own_forward(x):
        seen.append(x.shape)
        return model.lin(x)

    model.__dict__["forward"] = own_forward
    model.mark_forward_method("generate")
    model.generate(torch.ones(1, 2), times=2)
    assert seen == [(1, 2), (1, 2)] and model.__dict__["forward"] is own_forward


# -- Lightning conformance: what Lightning's own FSDP tests pin (issue 22 item 5) ---------------
def test_strategy_attributes_are_torchs_own_types() -> None:
    from torch.distributed.fsdp import CPUOffload as TorchOffload
    from torch.distributed.fsdp import MixedPrecision as TorchMP
    from torch.distributed.fsdp import ShardingStrategy as TorchSharding

    FSDPStrategy = fullshard.FSDPStrategy
    for given, name in [(None, "FULL_SHARD"), ("no_shard", "NO_SHARD"),
                        (TorchSharding.SHARD_GRAD_OP, "SHARD_GRAD_OP"),
                        (fullshard.FSDPType.ZERO2, "SHARD_GRAD_OP"),
                        (fullshard.ShardingStrategy.HYBRID_SHARD, "HYBRID_SHARD")]:
        s = FSDPStrategy() if given is None else FSDPStrategy(sharding_strategy=given)
        assert s.sharding_strategy is TorchSharding[name] and s.sharding_strategy.name == name
    assert FSDPStrategy(cpu_offload=True).cpu_offload == TorchOffload(offload_params=True)
    assert FSDPStrategy().cpu_offload == TorchOffload(offload_params=False)
    offload = TorchOffload()
    assert FSDPStrategy(cpu_offload=offload).cpu_offload is offload
    config = TorchMP(param_dtype=torch.bfloat16)
    assert FSDPStrategy(mixed_precision=config).mixed_precision_config is config
    bf16 = torch.bfloat16
    assert FSDPStrategy(precision="bf16-mixed").mixed_precision_config == TorchMP(
        param_dtype=bf16, reduce_dtype=bf16, buffer_dtype=bf16)
    f32 = torch.float32
    assert FSDPStrategy().mixed_precision_config == TorchMP(
        param_dtype=f32, reduce_dtype=f32, buffer_dtype=f32)


def test_strategy_checkpoint_io_and_mesh_exclusions() -> None:
    s = fullshard.FSDPStrategy()
    with pytest.raises(NotImplementedError, match="does not use the `CheckpointIO` plugin"):
        _ = s.checkpoint_io
    with pytest.raises(NotImplementedError, match="does not support setting a `CheckpointIO`"):
        s.checkpoint_io = object()
    with pytest.raises(ValueError, match=r"process_group=\.\.\., device_mesh=\.\.\.\)` are "
                                         r"mutually exclusive.*process_group=.*device_mesh="):
        fullshard.FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(1, 2),
                               process_group=object())


def test_strategy_precision_takes_fsdp_precision_plugins_only() -> None:
    s = fullshard.FSDPStrategy(precision=Precision("bf16-true"))
    assert s.precision == "bf16-true"
    with pytest.raises(TypeError, match="can only work with the `FSDPPrecision` plugin.*found"):
        fullshard.FSDPStrategy(precision=object())
    with pytest.raises(TypeError, match="can only work with the `FSDPPrecision` plugin"):
        s.precision = object()
    with pytest.raises(ValueError, match="precision='64-true' is not supported"):
        fullshard.FSDPStrategy(precision="64-true")
    try:
        from lightning.fabric.plugins import FSDPPrecision, HalfPrecision
    except ImportError:
        return
    with pytest.raises(TypeError, match="can only work with the `FSDPPrecision` plugin"):
        fullshard.FSDPStrategy(precision=HalfPrecision("bf16-true"))
    assert fullshard.FSDPStrategy(precision=FSDPPrecision("16-true")).precision == "16-true"


def test_precision_plugin_has_lightnings_signatures() -> None:
    p = Precision("16-mixed")
    w = torch.nn.Parameter(torch.ones(2))
    model = torch.nn.Linear(1, 1)
    loss = (w * 3.0).sum()
    p.backward(loss, model, retain_graph=True)  # (tensor, model, *args, **kwargs)
    p.backward(loss, model)  # the graph was retained: a second backward works
    scale = p.scaler.get_scale()
    assert torch.equal(w.grad, torch.full((2,), 6.0 * scale))
    opt = torch.optim.SGD([w], lr=1.0)  # not routed by setup_optimizer: the scaler steps it
    p.optimizer_step(opt)
    assert torch.equal(w.detach(), torch.full((2,), -5.0))  # 1 - 6 (unscaled)
    assert len(p.scaler._per_optimizer_states) == 0  # update() ran: the record is reset
    with pytest.raises(ValueError, match="is not supported in FSDP. `precision` must be one"):
        Precision("64-true")
    with pytest.raises(ValueError, match="`precision='bf16-mixed'` does not use a scaler"):
        Precision("bf16-mixed", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(TypeError, match="inf/NaN check covers every rank"):
        Precision("16-mixed", scaler=torch.amp.GradScaler("cpu"))
    from fullshard.api.precision import ShardedGradScaler

    mine = ShardedGradScaler("cpu", init_scale=8.0)
    assert Precision("16-mixed", scaler=mine).scaler is mine
    p = Precision("bf16-mixed")  # no scaler: a plain step with the keywords
    seen = []
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    opt.step = lambda **kw: seen.append(kw)
    p.optimizer_step(opt, closure=None)
    assert seen == [{"closure": None}]


def test_strategy_signature_is_readable_by_jsonargparse() -> None:
    import inspect

    params = inspect.signature(fullshard.FSDPStrategy).parameters
    strings = [n for n, p in params.items() if isinstance(p.annotation, str)]
    assert strings == [], f"string annotations jsonargparse cannot call: {strings}"
    typing.get_type_hints(fullshard.FSDPStrategy.__init__)
    jsonargparse = pytest.importorskip("jsonargparse")
    parser = jsonargparse.ArgumentParser()
    parser.add_argument("--device_mesh", type=params["device_mesh"].annotation)
    assert parser.parse_args(["--device_mesh=[1, 4]"]).device_mesh == (1, 4)
    parser = jsonargparse.ArgumentParser()
    parser.add_class_arguments(fullshard.FSDPStrategy, "strategy")
    ns = parser.parse_args(["--strategy.sharding_strategy=HYBRID_SHARD",
                            "--strategy.device_mesh=[1, 2]", "--strategy.cpu_offload=true"])
    assert ns.strategy.device_mesh == (1, 2) and ns.strategy.cpu_offload is True


def test_fabric_bad_calls_name_the_argument() -> None:
    with pytest.raises(ValueError, match=r"Fabric\(devices='two'\) is not a device count.*'auto'"):
        Fabric(accelerator="cpu", devices="two")
    strategy = fullshard.FSDPStrategy(accelerator="cpu")
    with pytest.raises(TypeError, match=r"got str 'adam' as optimizer 1.*torch\.optim"):
        strategy.setup_module_and_optimizers(torch.nn.Linear(2, 2), ["adam"])
    with pytest.raises(TypeError, match=r"optimizer 1 \(a class: instantiate it"):
        strategy.setup_optimizer(torch.optim.SGD)
    from fullshard.api.strategy_args import check_clip_val, check_max_norm, check_norm_type

    with pytest.raises(TypeError, match=r"max_norm=\.\.\.\) must be a positive number.*'1'"):
        check_max_norm("1")
    for bad in (-1.0, float("nan"), 0):
        with pytest.raises(ValueError, match=r"max_norm=\.\.\.\) must be a finite number > 0"):
            check_max_norm(bad)
    with pytest.raises(ValueError, match=r"norm_type='fro'\) is not supported.*'inf'"):
        check_norm_type("fro")
    with pytest.raises(ValueError, match=r"norm_type=nan\) must be a number >= 0"):
        check_norm_type(float("nan"))
    assert check_norm_type("inf") == float("inf") and check_norm_type(1) == 1.0
    with pytest.raises(TypeError, match=r"clip_val=\.\.\.\) must be a positive number"):
        check_clip_val(None)


class HasDevice(torch.nn.Module):
    """A model class with its own `device` (as Hugging Face models have): kept."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.note = "mine"

    @property
    def device(self) -> str:
        return "own"

    def forward(self, x):
        return self.lin(x)

    def double(self, x):
        return 2 * self(x)


def test_setup_returns_a_fabric_module_like_model(world1, tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    model = fabric.setup(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    assert model.device == fabric.device == torch.device("cpu")
    assert type(model.module) is torch.nn.Sequential and callable(model.mark_forward_method)
    own = HasDevice()
    set_up = fabric.setup(own)
    assert set_up is own and set_up.device == "own" and set_up.note == "mine"
    assert torch.equal(set_up.double(torch.ones(1, 4)), 2 * set_up(torch.ones(1, 4)))
    # Checkpoint calls with Lightning's exception types.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="Could not find a FSDP model in the provided"):
        fabric.save(tmp_path / "empty", {})
    path = tmp_path / "ckpt"
    fabric.save(path, {"model": model, "step": 3})
    whole = fabric.load(path)
    assert fabric.load(path, {}).keys() == whole.keys() and whole["step"] == 3
    with pytest.raises(NotImplementedError, match="load_raw"):
        fabric.load_raw(path, opt)
    with pytest.raises(NotImplementedError, match="single optimizer object"):
        fabric.strategy.load_checkpoint(path, opt)
    with pytest.raises(ValueError, match="must be a single file containing the full state"):
        fabric.load_raw(tmp_path, model)
    with pytest.raises(TypeError, match=r"max_norm=\.\.\.\) must be a positive number"):
        fabric.clip_gradients(model, opt, max_norm="1")
    with pytest.raises(ValueError, match=r"norm_type='fro'\) is not supported"):
        fabric.clip_gradients(model, opt, max_norm=1.0, norm_type="fro")


def test_lightning_differences_are_kept(world1, tmp_path: Path) -> None:
    """The README's "Lightning differences" that Lightning's own tests would flag: kept."""
    fabric = Fabric(accelerator="cpu", devices=1)
    model = fabric.setup(torch.nn.Linear(4, 3))
    aux = torch.nn.Linear(2, 2)  # never set up: a plain module
    # A sharded save refuses a non-empty folder that is not a checkpoint (Lightning writes
    # into it), and leaves the folder as it was.
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep")
    with pytest.raises(IsADirectoryError, match="not a checkpoint; saving would replace it"):
        fabric.save(folder, {"model": model})
    assert (folder / "notes.txt").read_text() == "keep"
    # A plain module, and two models, in one checkpoint (Lightning: one FSDP model only).
    path = tmp_path / "two"
    fabric.save(path, {"model": model, "aux": aux})
    aux2, model_sd = torch.nn.Linear(2, 2), dict(model.state_dict())
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    fabric.load(path, {"model": model, "aux": aux2})
    assert all(torch.equal(a, b) for a, b in zip(aux.parameters(), aux2.parameters()))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in model_sd.items())
    # state_dict_type is checked when the strategy is built, not at the first save.
    with pytest.raises(ValueError, match="state_dict_type='invalid'"):
        fullshard.FSDPStrategy(state_dict_type="invalid")
    # A bare loss.backward() is a valid backward outside '16-mixed' (no _FabricModule check).
    model(torch.ones(2, 4)).sum().backward()
    assert model.weight.grad is not None
    # The shard of a 2-D weight keeps its rows: (rows, in_features), not a flat 1-D shard.
    assert model.weight.dim() == 2 and model.weight.shape[1] == 4
    # '*-true' keeps no fp32 copy (the module itself is converted), so no warning says it does.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plugin = Precision("bf16-true")
        assert plugin.mixed_precision_config.param_dtype == torch.bfloat16
    assert plugin.convert_module(torch.nn.Linear(2, 2)).weight.dtype == torch.bfloat16

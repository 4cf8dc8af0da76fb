"""What the strategy needs without a process group: batches walked with their types kept, the
precision object Lightning's utilities accept, the options Lightning's own FSDP tests pin, and
`fullshard.Fabric`'s retirement (Lightning's own `Fabric` runs the strategy; compared with
Lightning where importable)."""

from __future__ import annotations

import collections
import dataclasses
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch

import fullshard
from fullshard.api.batches import cast_floating, map_batch
from fullshard.api.precision import Precision

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
        "text": "left alone",
    }
    out = map_batch(batch, lambda x: x.to(META), lambda x: isinstance(x, torch.Tensor))
    assert type(out["ordered"]) is collections.OrderedDict
    assert type(out["default"]) is collections.defaultdict
    assert out["default"].default_factory is list
    assert type(out["user"]) is collections.UserDict
    assert type(out["pair"]) is Pair and type(out["data"]) is Batch
    assert type(out["frozen"]) is Frozen
    assert out["data"].name == "b" and out["text"] == "left alone"
    assert out["list"][1][1] == 3 and type(out["list"][1]) is tuple
    leaves = [out["dict"]["t"], out["ordered"]["t"], out["default"]["a"], out["user"]["t"],
              out["pair"].x, out["data"].ids, out["data"].extra["m"], out["frozen"].ids,
              out["list"][0], out["list"][1][0]]
    assert all(x.device == META for x in leaves)
    # The original batch is untouched.
    assert batch["data"].ids.device.type == "cpu" and batch["default"]["a"].device.type == "cpu"


def test_transformers_batch_encoding_is_cast_as_itself() -> None:
    transformers = pytest.importorskip("transformers")
    cast = cast_floating(transformers.BatchEncoding({"x": torch.ones(2)}), torch.bfloat16)
    assert type(cast) is transformers.BatchEncoding and cast["x"].dtype == torch.bfloat16


def test_precision_casts_dataclass_inputs() -> None:
    out = cast_floating(Batch(ids=torch.ones(2), extra={"i": torch.ones(2, dtype=torch.long)}),
                        torch.bfloat16)
    assert out.ids.dtype == torch.bfloat16 and out.extra["i"].dtype == torch.long


# -- plugins and the precision object -----------------------------------------------------------
def test_lightning_precision_plugins_and_throughput_dtype() -> None:
    plugins = pytest.importorskip("lightning.fabric.plugins")
    throughput = pytest.importorskip("lightning.fabric.utilities.throughput")
    for name in ("32-true", "bf16-mixed", "16-true", "bf16-true"):
        ours = fullshard.FSDPStrategy(precision=name).precision
        assert isinstance(ours, plugins.Precision) and isinstance(ours, Precision)
        # The compute dtype Lightning derives equals the one of its own FSDP plugin.
        assert throughput._plugin_to_compute_dtype(ours) == (
            throughput._plugin_to_compute_dtype(plugins.FSDPPrecision(name)))
        assert ours.forward_context().__class__ is Precision(name).forward_context().__class__


def test_fullshard_never_imports_lightning() -> None:
    code = (
        "import sys, fullshard\n"
        "from fullshard.api.strategy import FSDPStrategy\n"  # the engine's, under Lightning's
        "p = FSDPStrategy(precision='bf16-mixed').precision\n"
        "assert type(p).__mro__[1] is object, type(p).__mro__\n"
        "assert not any(m.startswith(('lightning', 'pytorch_lightning')) for m in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr


def test_fullshard_fabric_is_gone_and_says_what_replaces_it() -> None:
    with pytest.raises(ImportError, match=r"L\.Fabric\(strategy=fullshard\.FSDPStrategy"):
        _ = fullshard.Fabric
    with pytest.raises(ImportError, match=r"L\.Fabric\(strategy=fullshard\.FSDPStrategy"):
        exec("from fullshard import Fabric")
    for name in ("seed_everything", "CSVLogger"):
        with pytest.raises(ImportError, match="lightning"):
            getattr(fullshard, name)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = fullshard.nope


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


def test_strategy_bad_calls_name_the_argument() -> None:
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


def _lightning_fabric():
    """Lightning's own Fabric on one CPU process with fullshard's strategy (the process group:
    the `world1` fixture's)."""
    lightning = pytest.importorskip("lightning")
    fabric = lightning.Fabric(accelerator="cpu", strategy=fullshard.FSDPStrategy(), devices=1)
    fabric.launch()
    return fabric


def test_checkpoint_calls_raise_lightnings_exception_types(world1, tmp_path: Path) -> None:
    fabric = _lightning_fabric()
    model = fabric.setup(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="Could not find a FSDP model in the provided"):
        fabric.save(tmp_path / "empty", {})
    path = tmp_path / "ckpt"
    fabric.save(path, {"model": model, "step": 3})
    assert fabric.load(path, {"model": model}) == {"step": 3}  # what `state` did not ask for
    whole = fabric.load(path)  # no state: the whole checkpoint, as one full-format dict
    assert fabric.load(path, {}).keys() == whole.keys() and whole["step"] == 3
    with pytest.raises(NotImplementedError, match="single optimizer object"):
        fabric.load_raw(path, opt)
    with pytest.raises(ValueError, match="must be a single file containing the full state"):
        fabric.load_raw(tmp_path, model)
    with pytest.raises(TypeError, match=r"max_norm=\.\.\.\) must be a positive number"):
        fabric.clip_gradients(model, opt, max_norm="1")
    with pytest.raises(ValueError, match=r"norm_type='fro'\) is not supported"):
        fabric.clip_gradients(model, opt, max_norm=1.0, norm_type="fro")


def test_lightning_differences_are_kept(world1, tmp_path: Path) -> None:
    """The README's "Lightning differences" that Lightning's own tests would flag: kept."""
    fabric = _lightning_fabric()
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
    # The shard of a 2-D weight keeps its rows: (rows, in_features), not a flat 1-D shard.
    assert model.weight.dim() == 2 and model.weight.shape[1] == 4
    # '*-true' keeps no fp32 copy (the module itself is converted), so no warning says it does.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plugin = Precision("bf16-true")
        assert plugin.mixed_precision_config.param_dtype == torch.bfloat16
    assert plugin.convert_module(torch.nn.Linear(2, 2)).weight.dtype == torch.bfloat16

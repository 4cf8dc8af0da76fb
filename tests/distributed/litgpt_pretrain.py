"""litgpt's own `pretrain.setup()` (litgpt 0.5.13), run with only its FSDPStrategy name
swapped: the script test_pretrain_example.py launches.

    fullshard run --nproc 2 tests/distributed/litgpt_pretrain.py OUT_DIR [FABRIC ...]
        [--backend=aot_eager | --no-compile]

Each FABRIC (default: `fullshard lightning`) runs litgpt's whole `setup()` in turn, in the same
2 ranks (one launch: the imports and process start-up are paid once), into `OUT_DIR/FABRIC`:

- `fullshard`: `litgpt.pretrain`'s `FSDPStrategy` name becomes fullshard's (its `L.Fabric`
  stays Lightning's own), so `setup()` builds `L.Fabric(strategy=FSDPStrategy(
  auto_wrap_policy={Block}, state_dict_type="full", sharding_strategy="HYBRID_SHARD"))` --
  litgpt's own arguments -- and
  `main()` runs as written: `fabric.init_module(empty_init=True)` (the meta device),
  `initialize_weights` (which skips the eager reset under an FSDPStrategy: the modules' own
  `reset_parameters()` run when `fabric.setup` materializes each unit), `torch.compile` before
  `fabric.setup`, `no_backward_sync`, `clip_gradients`, a full checkpoint at the end;
- `lightning`: the reference, the same `setup()` on Lightning's own Fabric with its DDP
  strategy (`L.Fabric` gets `strategy="ddp"` in place of the FSDPStrategy litgpt asks for,
  which Lightning does not run on CPU); `initialize_weights` then resets every module eagerly.

Both: fp32, a tiny Llama-style config, synthetic tokens from a fixed generator, the global
batch 8 = 2 ranks x micro-batch 2 x 2 accumulated micro-batches, 4 optimizer steps, litgpt's
CSV logger. Dynamo's caches are reset between the runs, so each compiles as a fresh process
would. `--backend=NAME` gives litgpt's `torch.compile(model)` that backend (the test uses
`aot_eager`: dynamo and AOT autograd trace as with inductor, without the minutes of C++ codegen
on a cold cache); `--no-compile` makes `torch.compile` the identity. Each run's wall time goes to
`OUT_DIR/FABRIC/seconds.txt`.
"""

from __future__ import annotations

import functools
import sys
import time
import types
from pathlib import Path

import lightning
import litgpt.pretrain as pretrain
import torch
from litgpt.args import EvalArgs, TrainArgs
from litgpt.config import Config
from litgpt.data import DataModule
from torch.utils.data import DataLoader

SEQ, VOCAB = 16, 64
CONFIG = Config(name="tiny-llama-test", block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB,
                n_layer=2, n_head=4, n_query_groups=2, n_embd=32, rotary_percentage=1.0,
                parallel_residual=False, bias=False, norm_class_name="RMSNorm",
                mlp_class_name="LLaMAMLP", intermediate_size=48)


class SyntheticTokens(DataModule):
    """Rows of SEQ + 1 tokens following a learnable pattern, the same in every process."""

    def connect(self, tokenizer=None, batch_size: int = 1, max_seq_length: int | None = None,
                **kwargs) -> None:
        self.batch_size = batch_size
        self.seq = max_seq_length

    def _rows(self, n: int, seed: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        step = torch.randint(1, 4, (n, 1), generator=g)
        return list((start + step * torch.arange(self.seq + 1)) % VOCAB)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self._rows(64, 0), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._rows(8, 1), batch_size=self.batch_size)


def run(which: str, out_dir: Path) -> None:
    original_fabric, original_strategy = pretrain.L, pretrain.FSDPStrategy

    def recorded(fabric):  # which strategy setup() really built, for the test to check
        out_dir.mkdir(parents=True, exist_ok=True)
        strategy = type(fabric.strategy)
        (out_dir / "strategy.txt").write_text(f"{strategy.__module__}.{strategy.__name__}\n")
        return fabric

    if which == "fullshard":
        import fullshard

        pretrain.L = types.SimpleNamespace(Fabric=lambda **kw: recorded(lightning.Fabric(**kw)))
        pretrain.FSDPStrategy = fullshard.FSDPStrategy
    elif which == "lightning":
        def ddp_fabric(**kwargs):
            kwargs["strategy"] = "ddp"
            return recorded(lightning.Fabric(accelerator="cpu", **kwargs))

        pretrain.L = types.SimpleNamespace(Fabric=ddp_fabric)
    else:
        raise SystemExit(f"fabrics: 'fullshard' or 'lightning', got {which!r}")
    world, micro, accumulate, steps = 2, 2, 2, 4
    torch._dynamo.reset()
    t0 = time.perf_counter()
    try:
        pretrain.setup(
            model_name="tiny-llama-test", model_config=CONFIG, out_dir=out_dir,
            precision="32-true", data=SyntheticTokens(), devices=world, logger_name="csv",
            train=TrainArgs(save_interval=None, log_interval=1,
                            global_batch_size=world * micro * accumulate,
                            micro_batch_size=micro,
                            max_tokens=steps * accumulate * micro * SEQ * world, max_norm=1.0,
                            min_lr=1e-4, lr_warmup_steps=1, tie_embeddings=False),
            eval=EvalArgs(interval=1000, max_iters=2, final_validation=True),
            optimizer={"class_path": "torch.optim.AdamW",
                       "init_args": {"lr": 3e-3, "weight_decay": 0.01}},
            seed=42,
        )
    finally:
        pretrain.L, pretrain.FSDPStrategy = original_fabric, original_strategy
    (out_dir / "seconds.txt").write_text(f"{time.perf_counter() - t0:.1f}\n")


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    backend = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--backend=")]
    out_dir, fabrics = Path(args[0]), args[1:] or ["fullshard", "lightning"]
    # litgpt writes its CLI's hyperparameters beside each checkpoint through jsonargparse,
    # which then needs `requests` (not a dependency of litgpt's pretraining, nor installed
    # here); the checkpoint itself is still written by fabric.save.
    pretrain.save_hyperparameters = lambda function, checkpoint_dir: None
    if "--no-compile" in sys.argv:
        torch.compile = lambda model, *args, **kwargs: model
    elif backend:
        torch.compile = functools.partial(torch.compile, backend=backend[0])
    for which in fabrics:
        run(which, out_dir / which)


if __name__ == "__main__":
    main()

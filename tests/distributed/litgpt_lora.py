"""litgpt 0.5.13's own `finetune/lora.py` `setup()`, with its one strategy line changed.

    python tests/distributed/litgpt_lora.py OUT_DIR --prepare    # the base checkpoint
    fullshard run --nproc 2 tests/distributed/litgpt_lora.py OUT_DIR FABRIC

litgpt's script builds `ModelParallelStrategy(parallelize_fn=...)` (torch FSDP2) when it runs
on more than one device; that is the one line changed:

- `fullshard`: `fullshard.FSDPStrategy(auto_wrap_policy={Block},
  activation_checkpointing_policy={Block}, state_dict_type="full")`, in Lightning's own Fabric;
- `lightning`: the reference, Lightning's DDP on CPU (`strategy="ddp"`, `accelerator="cpu"`);
- `fsdp2`: litgpt's script unchanged (torch FSDP2 through `ModelParallelStrategy`) on CPU.

Everything else is litgpt's: `load_checkpoint` (LoRA's key remapping on load),
`save_lora_checkpoint` (which calls `.full_tensor()` on the DTensors of `model.state_dict()`),
`merge_lora`. FABRIC runs `setup()` into `OUT_DIR/FABRIC`. One FABRIC per launch: a second
`setup()` in the same processes starts from state the first one left (its first losses differ).

Both: fp32, a tiny GPT whose LoRA rows split unevenly over 2 ranks (r=3), no dropout,
synthetic SFT rows, global batch 8 = 2 ranks x micro-batch 2 x 2 accumulated, 3 optimizer
steps, litgpt's CSV logger (per-iteration losses in full precision). `save_hyperparameters`
(jsonargparse re-parsing the command line) is replaced by a writer of the same
`hyperparameters.yaml` keys that `merge_lora` reads.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import lightning
import litgpt.finetune.lora as lora
import torch
import yaml
from litgpt.args import EvalArgs, TrainArgs
from litgpt.config import Config
from litgpt.data import DataModule
from litgpt.data.base import get_sft_collate_fn
from litgpt.model import GPT, Block
from litgpt.prompts import PromptStyle
from litgpt.utils import save_config
from torch.utils.data import DataLoader

SEQ, VOCAB = 12, 67
CONFIG = Config(name="tiny-lora-test", block_size=SEQ + 4, vocab_size=VOCAB,
                padded_vocab_size=VOCAB, n_layer=2, n_head=4, n_query_groups=2, n_embd=32,
                rotary_percentage=1.0, parallel_residual=False, bias=False,
                norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=40)
LORA = dict(lora_r=3, lora_alpha=6, lora_dropout=0.0, lora_query=True, lora_value=True,
            lora_head=True)


class SyntheticSFT(DataModule):
    """SFT rows (input ids, labels with a masked prompt) following a learnable pattern."""

    prompt_style = PromptStyle.from_name("alpaca")

    def connect(self, tokenizer=None, batch_size: int = 1, max_seq_length: int | None = None,
                **kwargs) -> None:
        self.batch_size = batch_size

    def _rows(self, n: int, seed: int) -> list[dict]:
        g = torch.Generator().manual_seed(seed)
        rows = []
        for _ in range(n):
            start, step = torch.randint(0, VOCAB, (1,), generator=g), torch.randint(1, 4, (1,),
                                                                                  generator=g)
            ids = (start + step * torch.arange(SEQ)) % VOCAB
            labels = ids.clone()
            labels[:3] = -100  # the prompt
            rows.append({"input_ids": ids, "labels": labels,
                         "token_counts": {"raw": SEQ - 3, "raw_plus_prompt_template": SEQ}})
        return rows

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self._rows(64, 0), batch_size=self.batch_size, shuffle=True,
                          collate_fn=get_sft_collate_fn())

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._rows(8, 1), batch_size=self.batch_size,
                          collate_fn=get_sft_collate_fn())


def make_checkpoint_dir(path: Path) -> None:
    """A base checkpoint as litgpt's `download` leaves it: weights, config, tokenizer."""
    from litgpt.lora import GPT as LoRAGPT
    from litgpt.lora import Config as LoRAConfig
    from tokenizers import Tokenizer, models

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(3)
    torch.save(GPT(CONFIG).state_dict(), path / "lit_model.pth")
    save_config(CONFIG, path)
    # The LoRA weights' starting values too, so that every strategy starts from the same
    # ones: litgpt initialises them on each strategy's path (eagerly, or under empty_init
    # when the strategy materialises the model), each drawing its random numbers in its
    # own order. `load_checkpoint(strict=False)` loads them with the base weights.
    lora_model = LoRAGPT(LoRAConfig.from_file(path / "model_config.yaml", **LORA))
    lora_model.load_state_dict(torch.load(path / "lit_model.pth"), strict=False)
    with torch.no_grad():
        for name, p in lora_model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)  # nonzero: lora_A gets gradients from the first step
    # under the base model's names, as litgpt's checkpoints are (its loaders map them)
    base_names = {k.replace(".linear.weight", ".weight").replace(".linear.bias", ".bias"): v
                  for k, v in lora_model.state_dict().items()}
    torch.save(base_names, path / "lit_model.pth")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(path / "tokenizer.json"))
    special = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
               "eos_token": "</s>"}
    (path / "tokenizer_config.json").write_text(json.dumps(special))


def write_hyperparameters(function, checkpoint_dir: Path, **_: object) -> None:
    hparams = {"checkpoint_dir": str(CHECKPOINT_DIR), "precision": "32-true", **LORA}
    (Path(checkpoint_dir) / "hyperparameters.yaml").write_text(yaml.safe_dump(hparams))


CHECKPOINT_DIR = Path()


def setup_arguments(checkpoint_dir: Path, out_dir: Path) -> dict:
    """The arguments of litgpt's fine-tuning `setup()`s (lora, full, adapter) for these runs:
    2 ranks x micro-batch 2 x 2 accumulated, 3 optimizer steps, a validation at each end."""
    world, micro, accumulate, steps = 2, 2, 2, 3
    return dict(
        checkpoint_dir=checkpoint_dir, out_dir=out_dir, precision="32-true", devices=world,
        data=SyntheticSFT(), logger_name="csv",
        train=TrainArgs(save_interval=1000, log_interval=1, epochs=100,
                        global_batch_size=world * micro * accumulate,
                        micro_batch_size=micro, max_steps=steps, lr_warmup_steps=1,
                        max_seq_length=None, max_time=None),
        eval=EvalArgs(interval=1000, max_new_tokens=4, max_iters=2,
                      initial_validation=True, final_validation=True),
        optimizer={"class_path": "torch.optim.AdamW",
                   "init_args": {"lr": 2e-2, "weight_decay": 0.01}},
        seed=42,
    )


def run(which: str, out_dir: Path) -> None:
    import fullshard

    original = lora.L, lora.ModelParallelStrategy
    if which == "fullshard":
        lora.ModelParallelStrategy = lambda **kwargs: fullshard.FSDPStrategy(
            auto_wrap_policy={Block}, activation_checkpointing_policy={Block},
            state_dict_type="full")
    elif which == "lightning":
        lora.ModelParallelStrategy = lambda **kwargs: "ddp"
    elif which == "fsdp2":
        pass  # litgpt's script unchanged: torch FSDP2 through Lightning's ModelParallelStrategy
    else:
        raise SystemExit(f"fabrics: 'fullshard' or 'lightning', got {which!r}")
    lora.L = types.SimpleNamespace(
        Fabric=lambda **kwargs: lightning.Fabric(accelerator="cpu", **kwargs))
    try:
        lora.setup(**setup_arguments(CHECKPOINT_DIR, out_dir), **LORA)
    finally:
        lora.L, lora.ModelParallelStrategy = original


def main() -> None:
    global CHECKPOINT_DIR
    out_dir, which = Path(sys.argv[1]), sys.argv[2]
    CHECKPOINT_DIR = out_dir / "base"
    if which == "--prepare":  # one process, before the launch
        make_checkpoint_dir(CHECKPOINT_DIR)
        return
    lora.save_hyperparameters = write_hyperparameters
    run(which, out_dir / which)


if __name__ == "__main__":
    main()

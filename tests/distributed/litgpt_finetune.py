"""litgpt 0.5.13's own `finetune/full.py` and `finetune/adapter.py` `setup()`, with only the
name `FSDPStrategy` changed.

    python tests/distributed/litgpt_finetune.py OUT_DIR SCRIPT --prepare   # base checkpoint
    fullshard run --nproc-per-node 2 tests/distributed/litgpt_finetune.py OUT_DIR SCRIPT FABRIC

SCRIPT is `full` or `adapter`. Both scripts build, on more than one device,
`FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block},
state_dict_type="full", limit_all_gathers=True, cpu_offload=False)` from
`lightning.fabric.strategies`; that name is the one thing changed:

- `fullshard`: the module's `FSDPStrategy` is `fullshard.FSDPStrategy` (same arguments), in
  Lightning's own Fabric;
- `lightning`: the reference, Lightning's DDP on CPU (`strategy="ddp"`; for adapter
  `"ddp_find_unused_parameters_true"`: litgpt's `CausalSelfAttention.adapter_kv_cache` is set
  by the first forward, the initial validation's, and never cleared, so the `adapter_wte`
  weights are unused from then on and plain DDP raises at the third iteration).

Both run with `L.Fabric(accelerator="cpu", ...)`. Everything else is litgpt's:
`load_checkpoint` (`fabric.load_raw` for an FSDP strategy, `load_state_dict` for DDP), its
training loop, `fabric.save` of the final checkpoint (`final/lit_model.pth` for full,
`final/lit_model.pth.adapter` for adapter, through `adapter_filter`). FABRIC runs
`setup()` into `OUT_DIR/SCRIPT/FABRIC`; the base checkpoint is `OUT_DIR/SCRIPT/base`.

fp32, the tiny GPT and synthetic SFT rows of litgpt_lora.py, global batch 8 = 2 ranks x
micro-batch 2 x 2 accumulated, 3 optimizer steps, litgpt's CSV logger. For adapter the
base config has adapter layers from block 0 (prompt length 3), and the base checkpoint holds
the adapter's starting values too (`load_checkpoint(strict=False)` loads them), with nonzero
gating factors so that the adapter embeddings get gradients from the first step.
`save_hyperparameters` (jsonargparse re-parsing the command line) is replaced by a small
writer.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
from pathlib import Path

import lightning
import litgpt.finetune.adapter as adapter
import litgpt.finetune.full as full
import torch
import yaml
from litgpt.adapter import GPT as AdapterGPT
from litgpt.adapter import Config as AdapterConfig
from litgpt.model import GPT
from litgpt.utils import save_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from litgpt_lora import CONFIG, setup_arguments  # noqa: E402

SCRIPTS = {"full": full, "adapter": adapter}
ADAPTER = dict(adapter_prompt_length=3, adapter_start_layer=0)


def make_checkpoint_dir(path: Path, script: str) -> None:
    """A base checkpoint as litgpt's `download` leaves it: weights, config, tokenizer."""
    from tokenizers import Tokenizer, models

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(3)
    state = GPT(CONFIG).state_dict()
    if script == "adapter":
        config = AdapterConfig(**{**dataclasses.asdict(CONFIG), **ADAPTER})
        model = AdapterGPT(config)
        model.load_state_dict(state, strict=False)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "gating_factor" in name:
                    p.normal_(std=0.5)  # zero-init would leave adapter_wte's first grads zero
        state = model.state_dict()
        save_config(config, path)
    else:
        save_config(CONFIG, path)
    torch.save(state, path / "lit_model.pth")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, CONFIG.vocab_size)}}
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(path / "tokenizer.json"))
    special = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
               "eos_token": "</s>"}
    (path / "tokenizer_config.json").write_text(json.dumps(special))


def write_hyperparameters(function, checkpoint_dir: Path, **_: object) -> None:
    hparams = {"checkpoint_dir": str(CHECKPOINT_DIR), "precision": "32-true"}
    (Path(checkpoint_dir) / "hyperparameters.yaml").write_text(yaml.safe_dump(hparams))


CHECKPOINT_DIR = Path()


def run(script: str, which: str, out_dir: Path) -> None:
    import fullshard

    module = SCRIPTS[script]
    original = module.L, module.FSDPStrategy
    if which == "fullshard":
        module.FSDPStrategy = fullshard.FSDPStrategy
    elif which == "lightning":
        # adapter: litgpt's adapter attention caches its prefix keys/values at the first
        # forward (the initial validation, under no_grad) and never clears them, so
        # `adapter_wte` gets no gradient; DDP then needs find_unused_parameters.
        reference = "ddp" if script == "full" else "ddp_find_unused_parameters_true"
        module.FSDPStrategy = lambda **kwargs: reference
    else:
        raise SystemExit(f"fabrics: 'fullshard' or 'lightning', got {which!r}")
    module.L = types.SimpleNamespace(
        Fabric=lambda **kwargs: lightning.Fabric(accelerator="cpu", **kwargs))
    try:
        module.setup(**setup_arguments(CHECKPOINT_DIR, out_dir))
    finally:
        module.L, module.FSDPStrategy = original


def main() -> None:
    global CHECKPOINT_DIR
    out_dir, script, which = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    if script not in SCRIPTS:
        raise SystemExit(f"scripts: 'full' or 'adapter', got {script!r}")
    CHECKPOINT_DIR = out_dir / script / "base"
    if which == "--prepare":  # one process, before the launch
        make_checkpoint_dir(CHECKPOINT_DIR, script)
        return
    SCRIPTS[script].save_hyperparameters = write_hyperparameters
    run(script, which, out_dir / script / which)


if __name__ == "__main__":
    main()

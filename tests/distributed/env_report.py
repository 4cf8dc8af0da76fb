"""Writes the fullshard/torchrun variables a worker of `fullshard run` sees to `argv[1]`."""

import json
import os
import sys

if os.environ.get("RANK", "0") == "0":
    with open(sys.argv[1], "w") as f:
        json.dump({k: v for k, v in os.environ.items()
                   if k.startswith(("FULLSHARD_", "TORCH_DISABLE", "TORCHELASTIC_SIGNALS"))}, f)

"""`python -m fullshard ...` is the `fullshard` command."""

import sys

from fullshard.cli import main

sys.exit(main())

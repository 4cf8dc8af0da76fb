# fullshard developer tasks.
#
#   make test                 create .venv (torch pinned by TORCH), lint, run the tests
#   make demo                 fullshard demo: train a small GPT on 2 CPU ranks (FULL_SHARD)
#   make demo TORCH=          bring your own torch: with TORCH empty the venv is created
#                             with --system-site-packages so an installed torch is used
#   make test VENV=/tmp/v     use another venv location
#
# torch is installed first and on its own, pinned: an unpinned torch would make pip pull
# a multi-GB CUDA build. The project install afterwards is constrained to the torch that
# is already there, so it never replaces it.

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0

VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip install -q --disable-pip-version-check
STAMP := $(VENV)/.fullshard-stamp

.PHONY: venv test demo lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(VPY) || $(PYTHON) -m venv $(if $(TORCH),,--system-site-packages) $(VENV)
	@if ! $(VPY) -c "import torch" 2>/dev/null; then \
	  if [ -z "$(TORCH)" ]; then \
	    echo "error: torch is not importable from $(VENV) and TORCH is empty" >&2; exit 1; \
	  fi; \
	  echo "installing $(TORCH) into $(VENV)"; \
	  $(PIP) "$(TORCH)"; \
	fi
	@$(VPY) -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/.torch-pin
	$(PIP) --constraint $(VENV)/.torch-pin -e ".[test,progress,plot]"
	@touch $@

test: venv
	$(VENV)/bin/ruff check .
	$(VPY) -m pytest -q tests

lint: venv
	$(VENV)/bin/ruff check .

demo: venv
	$(VENV)/bin/fullshard demo

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

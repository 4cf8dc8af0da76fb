# fullshard developer tasks.
#
#   make test                 create .venv (torch pinned by TORCH), lint, run the tests; then
#                             in .venv-litgpt (litgpt's pinned clients) the tests that need them
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
EXTRAS := test,progress,plot

# litgpt 0.5.13 caps huggingface-hub, hence transformers (5.3): its tests run in a venv of their
# own, beside the HF gradient-checkpointing test, so both transformers versions are covered.
# torch comes from pip's cache (or TORCH's on-disk wheel) the second time.
LITGPT_VENV ?= .venv-litgpt
LITGPT_STAMP := $(LITGPT_VENV)/.fullshard-stamp
LITGPT_EXTRAS := test,litgpt
LITGPT_TESTS := tests/distributed/test_pretrain_example.py \
	tests/distributed/test_hf_gradient_checkpointing.py
LITGPT_SELECT := litgpt or gradient_checkpointing

.PHONY: venv venv-litgpt test demo lint clean

# $(call make-venv,DIR,EXTRAS): DIR with torch pinned (see the top), then fullshard[EXTRAS]
define make-venv
	@test -x $(1)/bin/python || $(PYTHON) -m venv $(if $(TORCH),,--system-site-packages) $(1)
	@if ! $(1)/bin/python -c "import torch" 2>/dev/null; then \
	  if [ -z "$(TORCH)" ]; then \
	    echo "error: torch is not importable from $(1) and TORCH is empty" >&2; exit 1; \
	  fi; \
	  echo "installing $(TORCH) into $(1)"; \
	  $(1)/bin/python -m pip install -q --disable-pip-version-check "$(TORCH)"; \
	fi
	@$(1)/bin/python -c "import torch; print('torch==' + torch.__version__)" > $(1)/.torch-pin
	$(1)/bin/python -m pip install -q --disable-pip-version-check \
	  --constraint $(1)/.torch-pin -e ".[$(2)]"
	@touch $(1)/.fullshard-stamp
endef

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(call make-venv,$(VENV),$(EXTRAS))

venv-litgpt: $(LITGPT_STAMP)

$(LITGPT_STAMP): pyproject.toml Makefile
	$(call make-venv,$(LITGPT_VENV),$(LITGPT_EXTRAS))

test: venv venv-litgpt
	$(VENV)/bin/ruff check .
	$(VPY) -m pytest -q tests
	$(LITGPT_VENV)/bin/python -m pytest -q $(LITGPT_TESTS) -k "$(LITGPT_SELECT)"

lint: venv
	$(VENV)/bin/ruff check .

demo: venv
	$(VENV)/bin/fullshard demo

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache .hypothesis
	find . -path ./$(VENV) -prune -o -path ./$(LITGPT_VENV) -prune \
	  -o -name __pycache__ -type d -prune -exec rm -rf {} +

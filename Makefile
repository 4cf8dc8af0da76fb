# fullshard developer tasks.
#
#   make test                 create .venv (torch pinned by TORCH), lint, run the tests; then
#                             in .venv-litgpt (litgpt's pinned clients) the tests that need them
#   make demo                 fullshard demo: train a small GPT on 2 CPU ranks (FULL_SHARD)
#   make demo TORCH=          bring your own torch: with TORCH empty the venv is created
#                             with --system-site-packages so an installed torch is used
#   make test VENV=/tmp/v     use another venv location
#   make compat TORCH=torch==2.8.0
#                             the short compatibility job on that torch, in its own venv
#                             (.venv-torch-2.8.0): quick start, a short demo with a resume,
#                             the unit tests, and the checkpoint, DTensor state-dict, Lightning
#                             strategy, launch, hang-detection and parity tests
#   make compat-range         the same on the declared floor and on the newest torch
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
EXTRAS := test,progress,plot,demo

# litgpt 0.5.13 caps huggingface-hub, hence transformers (5.3): its tests run in a venv of their
# own, beside the HF gradient-checkpointing test, so both transformers versions are covered.
# torch comes from pip's cache (or TORCH's on-disk wheel) the second time.
LITGPT_VENV ?= .venv-litgpt
LITGPT_STAMP := $(LITGPT_VENV)/.fullshard-stamp
LITGPT_EXTRAS := test,litgpt
LITGPT_TESTS := tests/distributed/test_pretrain_example.py tests/distributed/test_litgpt_finetune.py \
	tests/distributed/test_hf_gradient_checkpointing.py
LITGPT_SELECT := litgpt or gradient_checkpointing

.PHONY: venv venv-litgpt test demo lint clean compat compat-range

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

# -- the short compatibility job --------------------------------------------------------------
# pyproject.toml declares torch>=TORCH_FLOOR; this job checks that claim on one torch. Versions
# other than the pinned one come from PyPI as full CUDA wheels (GBs): each venv is kept and
# reused while its torch is the one asked for, so only the first run downloads.
TORCH_FLOOR ?= torch==2.8.0
TORCH_NEWEST ?= torch==2.15.0
COMPAT_VENV = .venv-$(subst ==,-,$(TORCH))
COMPAT_PY = $(COMPAT_VENV)/bin/python
# the unit tests pin torch's own DTensor Shard(0) split, and DTensor state dicts and Lightning's
# Fabric use the torch APIs that differ most between releases
COMPAT_TESTS = \
	tests/unit \
	tests/distributed/test_dtensor_state_dict.py \
	tests/distributed/test_state_dict_loading.py \
	tests/distributed/test_lightning_fabric.py \
	tests/distributed/test_checkpoint_resume.py \
	tests/distributed/test_checkpoint_reshard.py \
	tests/distributed/test_checkpoint_formats.py \
	tests/distributed/test_restart.py \
	tests/distributed/test_launch.py \
	tests/distributed/test_netns_heartbeat.py \
	tests/distributed/test_parity.py \
	tests/distributed/test_compile.py \
	--deselect tests/distributed/test_compile.py::test_inductor_parity

# PIP_CONSTRAINT replaces any constraint file from pip's configuration for these installs: the
# job installs exactly $(TORCH), which a site-wide cap on torch would refuse; the project's own
# install is then constrained to that torch so pip never replaces it.
compat:
	@case "$(TORCH)" in torch==?*) ;; *) \
	  echo "error: make compat needs an exact torch, e.g. TORCH=torch==2.8.0; got TORCH='$(TORCH)'" >&2; \
	  exit 2;; esac
	@test -x $(COMPAT_PY) || $(PYTHON) -m venv $(COMPAT_VENV)
	@if [ "$$($(COMPAT_PY) -c 'import torch; print("torch==" + torch.__version__.split("+")[0])' \
	        2>/dev/null)" \
	      != "$(TORCH)" ]; then \
	  echo "installing $(TORCH) into $(COMPAT_VENV)"; \
	  PIP_CONSTRAINT=/dev/null $(COMPAT_PY) -m pip install -q --disable-pip-version-check \
	    "$(TORCH)" || exit 1; \
	fi
	@# the installed distribution's version: torch.__version__ may add a +cuXYZ the index lacks
	@$(COMPAT_PY) -c "from importlib.metadata import version; print('torch==' + version('torch'))" \
	  > $(COMPAT_VENV)/.torch-pin
	PIP_CONSTRAINT=$(COMPAT_VENV)/.torch-pin $(COMPAT_PY) -m pip install -q \
	  --disable-pip-version-check -e ".[test]"
	@echo "== $(TORCH): quick start (examples/train_fsdp.py, 2 ranks)"
	$(COMPAT_PY) examples/train_fsdp.py --steps 20
	@echo "== $(TORCH): fullshard demo (short) and its resume"
	rm -rf $(COMPAT_VENV)/demo
	$(COMPAT_VENV)/bin/fullshard demo --steps 20 --out $(COMPAT_VENV)/demo
	$(COMPAT_VENV)/bin/fullshard demo --steps 10 --resume --out $(COMPAT_VENV)/demo
	@echo "== $(TORCH): unit, checkpoint, state-dict, Lightning, launch, hang-detection, parity and compile tests"
	$(COMPAT_PY) -m pytest -q -p no:cacheprovider $(COMPAT_TESTS)

compat-range:
	$(MAKE) compat TORCH=$(TORCH_FLOOR)
	$(MAKE) compat TORCH=$(TORCH_NEWEST)

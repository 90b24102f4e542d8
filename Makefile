# megalab — learners: `make workspace` (then `make lab` in it); authors: `make lab`, `make test`.
# The Python the .venv is built on (>= 3.12): found by tools/find_python.sh unless given (make setup PYTHON=...).
PYTHON ?=
TORCH_VERSION ?= 2.13.0
VENV ?= .venv
# In a learner's workspace, `megalab workspace` writes this: the reference's environment, shared (no second install).
-include .megalab/env.mk
PY := $(VENV)/bin/python
STAMP := $(VENV)/.megalab-setup
PORT ?= 8888
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)
FIRST_NOTEBOOK := course/01_foundations/01_setup_and_torchrun.ipynb
WORKSPACE_DIR ?= $(HOME)/megalab-workspace
# The course's language: `make lab LANG=zh` (or COURSE_LANG=zh) for 简体中文. LANG given on the command line is
# taken for the course and not passed on as the locale (the recipes run with C.UTF-8 then).
# `LANG=zh make workspace` too: a LANG of two lowercase letters is a course language, never a locale (those read
# like en_US.UTF-8 or C.UTF-8).
ifeq ($(origin LANG),command line)
COURSE_LANG := $(LANG)
override LANG := C.UTF-8
export LANG
else ifneq ($(shell echo '$(LANG)' | grep -Ex '[a-z]{2}'),)
COURSE_LANG := $(LANG)
override LANG := C.UTF-8
export LANG
endif
COURSE_LANG ?= en
LANG_FLAG := $(if $(filter-out en,$(COURSE_LANG)),--lang $(COURSE_LANG),)
# In the reference repository a translated course is generated under build/<lang>/ (megalab translate build);
# a workspace made with --lang already holds its translated notebooks in course/.
LAB_DIR := $(if $(and $(filter-out en,$(COURSE_LANG)),$(if $(WORKSPACE),,1)),build/$(COURSE_LANG)/,)

.PHONY: setup lab workspace test unit nbval notebooks student grade bench lint clean gpu-test flash-attn

ifdef WORKSPACE
setup:
	@test -x $(PY) || { echo "The Python environment $(VENV) of the course ($(REFERENCE)) is gone: run 'make setup' there."; exit 1; }
else
setup: $(STAMP)
endif

# Re-runs only when the package's metadata changes. torch is installed on its own first, pinned, from the index
# megalab/lab/torch_build.py picks (it says which and why): on Linux without an NVIDIA driver PyTorch's CPU index
# (PyPI's default, the CUDA build, when that index is unreachable), with a driver a CUDA build it runs (PyPI's
# CUDA 13 from R580, else a cu12x index); TORCH_INDEX_URL=... chooses the index yourself.
# tools/make_venv.sh finds a Python >= 3.12 (or says what to install, creating nothing) and makes $(VENV) on it,
# recreating a $(VENV) that an older make setup built on an older Python.
$(STAMP): pyproject.toml
	@PYTHON="$(PYTHON)" sh tools/make_venv.sh $(VENV)
	@index=$$(TORCH_INDEX_URL="$(TORCH_INDEX_URL)" $(PY) -m megalab.lab.torch_build --torch $(TORCH_VERSION)) && \
		echo "$(PY) -m pip install -q torch==$(TORCH_VERSION) $$index" && \
		$(PY) -m pip install -q "torch==$(TORCH_VERSION)" $$index
	$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

# Optional, on a CUDA machine: flash-attn, which megalab/kernels uses when present. Its build imports torch, so it
# goes in after setup without build isolation (`pip install -e .[gpu]` fails); pip takes a prebuilt wheel matching
# torch and CUDA when there is one, else compiles (nvcc and ninja; long). Same version as pyproject's gpu extra.
flash-attn: setup
	$(PY) -m pip install -q packaging ninja psutil setuptools wheel
	$(PY) -m pip install --no-build-isolation "flash-attn>=2.6"

# JupyterLab at the root of this tree (course/ and megalab/ side by side), on the first notebook; the kernel
# and every rank import this tree's megalab (PYTHONPATH), `megalab` is on the terminal's PATH. No news pop-up and
# no update check (news_url=None): nothing covers the first notebook.
lab: setup
ifneq ($(LAB_DIR),)
	$(VENV)/bin/megalab translate build --lang $(COURSE_LANG)
endif
	PYTHONPATH=$(CURDIR) PATH=$(abspath $(VENV))/bin:$$PATH $(VENV)/bin/jupyter lab --ServerApp.root_dir=. \
		--LabApp.default_url=/lab/tree/$(LAB_DIR)$(FIRST_NOTEBOOK) --LabApp.news_url=None \
		--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate --ip=127.0.0.1 --port=$(PORT) $(ROOT_FLAG)

# Learners start here: your own copy of the course with every exercise blank, in seconds (DIR=... to choose).
workspace: setup
	$(VENV)/bin/megalab workspace $(or $(DIR),$(WORKSPACE_DIR)) $(LANG_FLAG)

# Every unit test and every notebook under strict nbval (outputs must match the committed ones), on two
# pytest workers: a multi-rank test spends about half its time waiting (rank start-up, rendezvous, I/O), so
# two test files at once keep both cores busy. A notebook's cells stay together on one worker (loadfile).
# Files are handed out in collection order (--no-loadscope-reorder; xdist would otherwise put the files with the
# most tests first), so the two longest files, put first by tests/conftest.py, start at once on the two workers.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest tests course --nbval -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# On a GPU node: the gpu-marked tests and every notebook's cells on CUDA (NCCL where a cell's ranks fit the GPUs,
# else gloo with the ranks sharing the GPUs, p2p staged through host memory), compared with the committed CPU
# outputs; the table and the course/INSTRUCTORS.md row to paste. Without CUDA it says "no CUDA GPU" and runs nothing;
# with an NVIDIA driver this torch cannot use, "CUDA present but unusable" and fails (exit 2).
# `python -m megalab.lab.gpu_check --plan 8` shows the plan anywhere.
gpu-test: setup
	$(PY) -m megalab.lab.gpu_check

unit: setup
	$(PY) -m pytest tests -q

nbval: setup
	$(PY) -m pytest course --nbval -q

notebooks: setup
	$(VENV)/bin/megalab notebooks course

student: setup
	$(VENV)/bin/megalab student $(or $(DIR),../megalab-student) $(LANG_FLAG)

# Per-exercise table for this tree (a workspace or the reference): ID=dist.shard_bounds, CHAPTER=01, or all.
grade: setup
	$(VENV)/bin/megalab grade $(or $(ID),$(CHAPTER))

bench: setup
	@for b in benchmarks/[a-z]*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

lint: setup
	$(VENV)/bin/ruff check megalab tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .megalab

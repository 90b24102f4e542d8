# megalab — `make lab` to study, `make test` to grade/verify. Both set up .venv first.
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.megalab-setup
PORT ?= 8888
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: setup lab test unit nbval notebooks student bench lint clean

setup: $(STAMP)

# Re-runs only when the package's metadata changes. torch is installed on its own first, pinned:
# on a CPU machine pip takes the CPU wheel; on a GPU cluster the same line gets a CUDA build.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

lab: setup
	$(VENV)/bin/jupyter lab --notebook-dir=course --ip=127.0.0.1 --port=$(PORT) $(ROOT_FLAG)

# Unit tests, then every notebook under strict nbval (outputs must match the committed ones).
test: setup
	$(PY) -m pytest tests course --nbval -q

unit: setup
	$(PY) -m pytest tests -q

nbval: setup
	$(PY) -m pytest course --nbval -q

notebooks: setup
	$(VENV)/bin/megalab notebooks course

student: setup
	$(VENV)/bin/megalab student $(or $(DIR),../megalab-student)

bench: setup
	$(PY) benchmarks/launcher_overhead.py
	$(PY) benchmarks/teardown_soak.py
	$(PY) benchmarks/allreduce.py
	$(PY) benchmarks/data_parallel.py

lint: setup
	$(VENV)/bin/ruff check megalab tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .megalab

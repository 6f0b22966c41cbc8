# Every target creates .venv/ in the repository root and installs the package into it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint bench gpu-report clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The pinned CPU build first: an unpinned torch would pull several GB of CUDA wheels.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,examples]"
	touch $(STAMP)

demo: setup
	$(PY) examples/custom_training_loop.py --strategy mirrored --epochs 11 --batch-size-per-replica 16 --cosine-decay

test: setup
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q

bench: setup
	$(PY) benchmarks/run_all.py

# On a GPU machine: tests/test_gpu.py and the GPU benchmarks, one dated report in benchmarks/.
# Uses the interpreter whose torch sees the GPU (no .venv: GPU machines carry a CUDA torch);
# without a GPU it prints its plan and exits 0.
gpu-report:
	$(PYTHON) benchmarks/gpu_report.py

clean:
	rm -rf $(VENV) build *.egg-info

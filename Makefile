# Every target creates .venv/ in the repository root and installs the package into it.
#
# Which torch: TORCH_INDEX is a wheel index pip reads besides PyPI (and any local wheels).
# By default it is PyTorch's CPU-only index when that index answers, so a stock machine gets
# the CPU build of $(TORCH_SPEC) (`2.13.0+cpu` sorts above PyPI's CUDA `2.13.0`), not several
# GB of CUDA wheels; where it does not answer (an offline mirror) pip uses what it is
# configured with. For NVIDIA GPUs name the CUDA build matching your driver, e.g.
#     make setup TORCH_INDEX=https://download.pytorch.org/whl/cu126
# and TORCH_INDEX= (empty) takes pip's default build. `make setup` prints which it installed.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
CPU_INDEX := https://download.pytorch.org/whl/cpu
TORCH_INDEX ?= $(shell $(PYTHON) -c "import urllib.request as u; u.urlopen('$(CPU_INDEX)/', timeout=5); print('$(CPU_INDEX)')" 2>/dev/null)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-matrix lint typecheck docs docs-serve bench gpu-report clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip uv
	# torch first, with pip, from TORCH_INDEX (see above) and what pip is configured with (a
	# local wheel mirror), so that the package's `torch>=` is already met.
	$(PY) -m pip install -q "$(TORCH_SPEC)" $(if $(strip $(TORCH_INDEX)),--extra-index-url $(TORCH_INDEX))
	# The package and its ~100 dependencies with uv, which fetches them in parallel: about 17 s
	# instead of pip's 38 on the 2-core CI machine. Byte-compiled, as pip would: the tests set
	# PYTHONDONTWRITEBYTECODE, and their hundreds of processes would each compile them again.
	# uv does not read pip's configuration: behind a private index, set UV_INDEX_URL too.
	# ft: torchft (per-step fault tolerance), which needs torch>=2.7: leave it out of a setup
	# that tests an older torch.
	$(VENV)/bin/uv pip install --python $(PY) --quiet --compile-bytecode -e ".[test,examples,docs,ft]"
	@$(PY) -c "import torch; print('installed torch', torch.__version__, '(' + ('CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU-only') + ' build)')"
	touch $(STAMP)

demo: setup
	$(PY) examples/custom_training_loop.py --strategy mirrored --epochs 11 --batch-size-per-replica 16 --cosine-decay

lint: setup
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports

typecheck: setup
	$(PY) -m mypy

docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

docs-serve: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

# The suite in two passes on 2 pytest-xdist workers: in-process tests handed out a few at a time
# (`--dist loadgroup` without groups), the `slow` ones first so that they run side by side,
# then the tests that start processes (marked `serial` by tests/conftest.py) spread file by
# file, so that a module's training job (a module-scoped fixture) runs once. Byte-compiled first:
# the suite starts hundreds of worker processes, and where PYTHONDONTWRITEBYTECODE is set each
# of them would compile the package again (0.7 s of CPU each). The checks first, side by side
# (each mostly uses one core: 23 s instead of 29 from cold caches).
test: setup
	$(MAKE) --no-print-directory -j3 --output-sync=target lint typecheck docs
	$(PY) -m compileall -q torch_distribute tests examples benchmarks > /dev/null
	$(PY) -m pytest -q -m "not serial" -n 2 --dist loadgroup
	$(PY) -m pytest -q -m serial -n 2 --dist loadfile

# The supported torch range, tested at its ends (pyproject's `torch>=` is the oldest): each
# version of MATRIX_TORCH in a venv of its own, .venv-torch-VERSION (kept for the next run), with
# the package and its test extra, then the in-process pass in one long process (what a user's
# long-lived training process meets) and the process pass. Not part of `make test` or CI: a
# torch other than the local CPU build (2.13.0) is a CUDA wheel of several GB from the package index.
MATRIX_TORCH ?= 2.13.0 2.14.1
test-matrix:
	@set -e; for version in $(MATRIX_TORCH); do \
	  venv=.venv-torch-$$version; \
	  test -x $$venv/bin/python || $(PYTHON) -m venv $$venv; \
	  $$venv/bin/python -m pip install -q --upgrade pip uv; \
	  $$venv/bin/python -m pip install -q "torch==$$version"; \
	  $$venv/bin/uv pip install --python $$venv/bin/python --quiet --compile-bytecode -e ".[test,examples,ft]" "torch==$$version"; \
	  echo "== torch $$version: in-process pass (one process)"; \
	  $$venv/bin/python -m pytest -q -p no:cacheprovider -m "not serial" -n 0; \
	  echo "== torch $$version: process pass"; \
	  $$venv/bin/python -m pytest -q -p no:cacheprovider -m serial -n 2 --dist loadfile; \
	done

bench: setup
	$(PY) benchmarks/run_all.py

# On a GPU machine: tests/test_gpu.py and the GPU benchmarks, one dated report in benchmarks/.
# Uses the interpreter whose torch sees the GPU (no .venv: GPU machines carry a CUDA torch);
# without a GPU it prints its plan and exits 0. ARGS: its options, e.g. ARGS="--only issue45 --budget 540".
gpu-report:
	$(PYTHON) benchmarks/gpu_report.py $(ARGS)

clean:
	rm -rf $(VENV) build dist site *.egg-info

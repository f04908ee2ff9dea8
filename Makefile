# `make demo` and `make test` build .venv from nothing when it is missing or stale.
# The stack is installed explicitly: torchrec's metadata asks for the CUDA
# fbgemm-gpu, which would overwrite fbgemm-gpu-cpu, so torchrec and this package
# go in with --no-deps. Every package is pinned in requirements/constraints.txt.
# Installing this package also builds its optional C++ operators (overlap_optim/csrc)
# with the system's C++ compiler; without one they are skipped.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.overlap-optim-installed
PINS := -c requirements/constraints.txt
PYTEST_ARGS ?=
DEMO_ARGS ?=

.PHONY: env demo test test-matrix bench-smoke constraints clean

env: $(STAMP)

$(STAMP): setup.py Makefile $(wildcard requirements/*.txt) $(wildcard overlap_optim/csrc/*.cpp) $(wildcard overlap_optim/csrc/*.h)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "setting up $(VENV) (pinned stack; a satisfied package is skipped)"
	$(PIP) install $(PINS) -r requirements/stack.txt
	$(PIP) install --no-deps -r requirements/torchrec.txt
	$(PIP) install $(PINS) -r requirements/runtime.txt -r requirements/test.txt -r requirements/examples.txt -r requirements/layerwise.txt
	$(PIP) install --no-deps --no-build-isolation -e .
	@$(PY) -m pip list 2>/dev/null | grep -qiE '^fbgemm[-_]gpu ' && \
		{ echo "error: the CUDA fbgemm-gpu got installed and breaks fbgemm-gpu-cpu; run: make clean env"; exit 1; } || true
	$(PY) -c "import torchrec, fbgemm_gpu, overlap_optim, sharders"
	@$(PY) -c "from overlap_optim import compiled; print('compiled operators (overlap_optim/csrc):', \
		'built' if compiled.available() else 'not built (no C++ compiler?): the slower pure-torch paths run')"
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/movielens.py $(DEMO_ARGS)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# The promise matrix at scale: MATRIX_EXAMPLES sampled configurations (default 2000) from a random
# seed, printed at the end; repeat a run with PYTEST_ARGS=--hypothesis-seed=N.
test-matrix: $(STAMP)
	HYPOTHESIS_PROFILE=matrix $(PY) -m pytest tests/test_promise_matrix.py --timeout=0 --hypothesis-show-statistics $(PYTEST_ARGS)

constraints: $(STAMP)
	@{ echo "# Every package of the environment, pinned. Regenerate: make constraints"; \
	  $(PY) -m pip freeze --exclude-editable 2>/dev/null | sed 's/+cpu//'; } > requirements/constraints.txt

clean:
	rm -rf $(VENV) build overlap_optim/_compiled*.so

# Two entry points on a fresh machine: `make demo` and `make test`. Both create .venv when missing.
PY := .venv/bin/python
VENV_STAMP := .venv/.installed
LOCK := requirements.lock
# The lock is for this project's machines: CPython 3.11 on x86_64 Linux, torch from the CPU wheel on disk.
LOCK_COMPILE := pip compile requirements.txt --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
	--find-links /opt/wheels --generate-hashes --quiet --custom-compile-command "make lock"
# mypy finds the package through a folder holding one link named fxforge (the repository root is the package).
MYPY_PATH := .venv/mypy-path

export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
# The repository root is the package itself: keep it off sys.path (python -P), so its folders are never
# importable as top-level modules (transformers probes `kernels`), in tests and their subprocesses alike.
export PYTHONSAFEPATH ?= 1

.PHONY: demo test test-deploy test-search test-slow test-reach lint typecheck venv lock clean-venv

venv: $(VENV_STAMP)

# A venv is built from the lock alone, from scratch: a changed lock never leaves old packages behind.
$(VENV_STAMP): $(LOCK) pyproject.toml
	rm -rf .venv
	python3 -m venv .venv
	$(PY) -m pip install -q --require-hashes -r $(LOCK)
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	mkdir -p $(MYPY_PATH) && ln -sfn "$(CURDIR)" $(MYPY_PATH)/fxforge
	touch $(VENV_STAMP)

demo: $(VENV_STAMP)
	$(PY) -m fxforge.examples.demo

test: lint
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not reach and not slow_deploy and not slow_search and not slow" tests

# The slow deploy compiles: the sweep's AOTInductor half (every zoo and tiny HF model compiled to a .pt2 and
# checked), the other AOTI packages and the ExecuTorch lowering, about 6 minutes of CPU that would take
# `make test` past its 12-minute budget. CI runs it after `make test`.
test-deploy: $(VENV_STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile -m slow_deploy tests

# Searches that really train (multi-fidelity rungs, sensitivity on a trained model): minutes of CPU, run by CI.
test-search: $(VENV_STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile -m slow_search tests

# Everything `make test` leaves out for time (markers slow_deploy, slow_search, slow; not the reach sweep): what
# CI runs after `make test`.
test-slow: $(VENV_STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile -m "slow_deploy or slow_search or slow" tests

# The architecture reach sweep (tests/reach): all its tiny transformers architectures, not only `test`'s 12.
test-reach: $(VENV_STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup tests/reach

lint: $(VENV_STAMP)
	$(PY) -m ruff check .
	$(MAKE) --no-print-directory typecheck

typecheck: $(VENV_STAMP)
	cd $(MYPY_PATH) && MYPYPATH=. ../bin/python -m mypy --config-file "$(CURDIR)/pyproject.toml" \
		--cache-dir "$(CURDIR)/.mypy_cache" -p fxforge

# Refresh the lock: compile the newest versions requirements.txt allows, build a venv from scratch from
# them, run the whole suite there, and only then replace requirements.lock (commit it with the result).
lock: $(VENV_STAMP)
	rm -rf .lock-check && mkdir -p .lock-check
	$(PY) -m uv $(LOCK_COMPILE) --upgrade -o .lock-check/$(LOCK)
	python3 -m venv .lock-check/venv
	.lock-check/venv/bin/python -m pip install -q --require-hashes -r .lock-check/$(LOCK)
	.lock-check/venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	.lock-check/venv/bin/python -m ruff check .
	.lock-check/venv/bin/python -m pytest -q -n 2 --dist loadfile -p no:cacheprovider tests
	cp .lock-check/$(LOCK) $(LOCK)
	rm -rf .lock-check
	@echo "requirements.lock refreshed and tested; the next make rebuilds .venv from it"

clean-venv:
	rm -rf .venv

# Two entry points on a fresh machine: `make demo` and `make test`. Both create .venv when missing.
PY := .venv/bin/python
VENV_STAMP := .venv/.installed

export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
# The repository root is the package itself: keep it off sys.path (python -P), so its folders are never
# importable as top-level modules (transformers probes `kernels`), in tests and their subprocesses alike.
export PYTHONSAFEPATH ?= 1

.PHONY: demo test lint venv clean-venv

venv: $(VENV_STAMP)

$(VENV_STAMP): requirements.txt constraints.txt pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -r requirements.txt
	$(PY) -m pip install -q -c constraints.txt --no-deps --no-build-isolation -e .
	touch $(VENV_STAMP)

demo: $(VENV_STAMP)
	$(PY) -m fxforge.examples.demo

test: lint
	$(PY) -m pytest -q -n 2 --dist loadfile tests

lint: $(VENV_STAMP)
	$(PY) -m ruff check .

clean-venv:
	rm -rf .venv

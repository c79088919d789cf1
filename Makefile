# Developer entry points. Each target sets up what it needs: a venv with pinned torch and tools,
# then the extension built in place (nvcc CUDA kernels when torch has CUDA and nvcc is found).
#
#   make demo              set up, build, run the end-to-end demo (the main job)
#   make test              set up, build, run the test suite (what CI runs)
#   make bench             set up, build, run every microbenchmark
#   make test TORCH=2.13.0 the same against the CPU-only torch build (no nvcc use)
#   make ctest             torch-free native targets: emulator self-tests, the bf16 prefill test
#                          of the CPU kernels of every instruction set (also under ASan + UBSan),
#                          the tensor-core wrappers through nvcc
#   make sanitize          the simt suites on an ASan + UBSan build of pagedkv._simt, and the
#                          emulator self-tests under TSan (what CI runs after `make test`)
#   make lint              ruff over python, tests, bench, docs and setup.py
#   make docs              the documentation site (docs/*.md and the API reference from the
#                          docstrings) into build/docs/index.html; warnings are errors

TORCH ?= 2.14.1
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pagedkv-torch-$(TORCH)
CUDA_HOME ?= /usr/local/cuda
export MAX_JOBS ?= $(shell nproc)
ifeq ($(TORCH),2.13.0)
export PAGEDKV_CUDA ?= 0
endif

.PHONY: setup build test demo bench lint docs ctest sanitize sanitize-address \
	sanitize-address-build sanitize-thread clean

setup: $(STAMP)

$(STAMP): requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	rm -f $(VENV)/.pagedkv-torch-*
	$(PY) -m pip install -q torch==$(TORCH) -r requirements-dev.txt
	touch $@

EDITABLE := $(VENV)/.pagedkv-editable

build: setup $(EDITABLE)
	$(PY) setup.py -q build_ext --inplace

# The source tree on the venv's path and the `pagedkv` command, once; the modules are built in
# place by build_ext above, so rebuilds are incremental.
$(EDITABLE): pyproject.toml
	PAGEDKV_EXT=0 $(PY) -m pip install -q --no-build-isolation --no-deps \
		--config-settings editable_mode=compat -e .
	touch $@

# pytest-xdist: one worker per core, an idle one taking tests from a busy one (worksteal);
# TEST_JOBS=0 runs the suite in this process.
TEST_JOBS ?= auto

test: build
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist worksteal

demo: build
	$(VENV)/bin/pagedkv demo

bench: build
	$(PY) -m bench

lint: setup
	$(VENV)/bin/ruff check python tests bench docs setup.py

DOCS_STAMP := $(VENV)/.pagedkv-docs

$(DOCS_STAMP): requirements-docs.txt $(STAMP)
	$(PY) -m pip install -q -r requirements-docs.txt
	touch $@

# autodoc imports the package, so the modules are built first.
docs: build $(DOCS_STAMP)
	$(PY) -m sphinx -W --keep-going -q -b html docs build/docs

# ctest and sanitize-thread need cmake and ninja, no torch: the venv's ninja (NATIVE_TOOLS=venv,
# the default), or the cmake and ninja on PATH (NATIVE_TOOLS=system: no venv, so CI runs them
# while `make setup` installs it).
NATIVE_TOOLS ?= venv
ifeq ($(NATIVE_TOOLS),venv)
NATIVE_DEPS := setup
NATIVE_ENV := PATH=$(CURDIR)/$(VENV)/bin:$$PATH
endif

ctest: $(NATIVE_DEPS)
	$(NATIVE_ENV) cmake -S . -B build/cmake -G Ninja \
		-DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CUDA_COMPILER=$(CUDA_HOME)/bin/nvcc
	$(NATIVE_ENV) cmake --build build/cmake
	ctest --test-dir build/cmake --output-on-failure -j $(MAX_JOBS)

# ASan + UBSan: pagedkv._simt built again into build/simt-address (the in-place module stays),
# then every suite on the simt backend and the emulator self-tests with it. libasan must come
# first in the process, libstdc++ with it (or ASan misses the first C++ throw); Python leaks by
# design. A fault aborts pytest with the sanitizer's report (--capture=sys: pytest's capture of
# the file descriptors would swallow it).
SANITIZE_LIBS = $$($(CXX) -print-file-name=libasan.so) $$($(CXX) -print-file-name=libstdc++.so)
sanitize-address: build sanitize-address-build
	PAGEDKV_SIMT_SANITIZE=address PAGEDKV_TEST_BACKENDS=simt LD_PRELOAD="$(SANITIZE_LIBS)" \
		ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
		$(PY) -m pytest -q -n $(TEST_JOBS) --dist worksteal --capture=sys tests/ops tests/simt

# The ASan + UBSan module alone (needs the venv, not the in-place build; CI starts it early).
sanitize-address-build: setup
	PAGEDKV_SIMT_SANITIZE=address $(PY) setup.py -q build_ext

# TSan: the torch-free emulator self-tests, and the race check of a missing __syncthreads.
sanitize-thread: $(NATIVE_DEPS)
	$(NATIVE_ENV) cmake -S . -B build/tsan -G Ninja \
		-DCMAKE_BUILD_TYPE=RelWithDebInfo -DSIMT_SANITIZE=thread -DCUDAToolkit_ROOT=$(CUDA_HOME)
	$(NATIVE_ENV) cmake --build build/tsan
	ctest --test-dir build/tsan --output-on-failure -j2

sanitize: sanitize-address sanitize-thread

clean:
	rm -rf build python/pagedkv/*.so

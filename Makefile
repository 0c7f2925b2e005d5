# Two commands on a fresh machine: `make test` and `make demo`. Each creates .venv when needed
# and builds the compiled core (a C++17 compiler is needed), again whenever csrc/ changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo bench clean peers asan

$(STAMP): pyproject.toml constraints.txt setup.py $(wildcard csrc/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,bench]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest

demo: $(STAMP)
	$(PY) -m flybatch.demo

bench: $(STAMP)
	$(PY) -m flybatch.bench all --quick

clean:
	rm -rf $(VENV) build src/flybatch/*.so

# The test suite once against a core built with AddressSanitizer and UBSan. The build goes to
# build/asan with a copy of the package, so the regular core stays as it is. Python itself is
# not instrumented: the sanitizer runtime is preloaded (with libstdc++, which python does not
# link, so that ASan finds the C++ runtime it intercepts), leak checks are off because CPython
# keeps some memory until exit by design, and pytest captures only Python's output so that a
# sanitizer report reaches the terminal.
ASAN := build/asan
asan: $(STAMP)
	rm -rf $(ASAN)
	mkdir -p $(ASAN)
	cp -r src/flybatch $(ASAN)/flybatch
	rm -f $(ASAN)/flybatch/*.so
	FLYBATCH_SANITIZE=1 $(PY) setup.py -q build_ext --build-lib $(ASAN) --build-temp $(ASAN)/obj
	PYTHONPATH=$(ASAN) \
	LD_PRELOAD="$$(g++ -print-file-name=libasan.so) $$(g++ -print-file-name=libstdc++.so)" \
	ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	$(PY) -m pytest -x -q -p no:cacheprovider --capture=sys

# The DyNet peers of the dynet-* benchmark modes (scripts/install-peers.sh): .venv-peers with
# DyNet 2.1.2 compiled from source (minutes) and .venv-peers-22 with the DyNet 2.2 wheel
# (seconds); DYNET=2.1.2 or DYNET=2.2 installs only that one. They import flybatch from src/,
# so the core is built first, by the same Python. Never part of `make test`.
DYNET ?= all
peers: $(STAMP)
	PYTHON=$(PYTHON) bash scripts/install-peers.sh $(DYNET)

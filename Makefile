# Two commands on a fresh machine: `make test` and `make demo`. Each creates .venv when needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo bench clean peers

$(STAMP): pyproject.toml constraints.txt
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
	rm -rf $(VENV)

# DyNet 2.1.2 peer environment (.venv-peers) for the dynet-* benchmark modes; compiles
# DyNet (several minutes). Never part of `make test`.
peers:
	bash scripts/install-peers.sh

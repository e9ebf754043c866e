# dynprof developer tasks. `make test` is what CI runs (through .ci/run).
PYTHON ?= python3

.PHONY: setup demo test test-gpu lint proto bench

setup:
	bash scripts/setup_dev.sh

demo: setup
	$(PYTHON) scripts/demo.py

test: setup
	$(PYTHON) -m pytest -q -n 4 --dist loadgroup --durations=30

test-gpu:
	$(PYTHON) -m pytest -q -m gpu

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m mypy
	lint-imports
	$(PYTHON) scripts/check_private_imports.py

proto:
	$(PYTHON) scripts/gen_proto.py

bench:
	$(PYTHON) scripts/bench_agent.py

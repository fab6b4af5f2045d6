# Set-up from a machine that has only Python: `make train` or `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train test lint format bench clean mutate

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: the CPU wheel on disk; the range in pyproject then installs nothing newer.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,hf,tensorboard,controller]'
	# Monarch without its dependencies: they are the [controller] extra; resolving them from the
	# wheel would replace torch (it names the torch it was built with). pip cannot say --no-deps
	# in an extra, so it is this line (docs/controller.md).
	$(PY) -m pip install -q --no-deps torchmonarch==0.7.0
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/plait train configs/default.toml

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports  # the import layers and contracts of pyproject.toml
	$(PY) -m pytest -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: $(STAMP)
	$(PY) benchmarks/ddp.py

clean:
	rm -rf $(VENV) runs .pytest_cache

# Mutation testing of one module against its tests (tools/mutate.py maps them; TESTS= overrides):
#   make mutate MODULE=plait/gradsync.py [TESTS="tests/test_x.py tests/test_y.py"]
mutate: $(STAMP)
	@test -n "$(MODULE)" || { echo "make mutate: name the module, e.g. MODULE=plait/gradsync.py"; exit 2; }
	$(PY) tools/mutate.py $(MODULE) $(if $(TESTS),--tests $(TESTS))

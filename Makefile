# Two commands on a fresh machine: `make demo` and `make test`. Each bootstraps .venv itself.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck bench guest-image tools clean

$(STAMP): pyproject.toml
	@bash scripts/bootstrap.sh
	@touch $(STAMP)

tools: $(STAMP)

demo: $(STAMP)
	$(BIN)/vmfence demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(BIN)/ruff check .

typecheck: $(STAMP)
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/vmfence bench decisions --keys 10000 --json

guest-image: $(STAMP)
	bash scripts/build-guest-image.sh

clean:
	rm -rf $(VENV) build .vmfence

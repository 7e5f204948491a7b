# MegaMoE: `make demo` runs the main job, `make test` the whole suite. Both set themselves up.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU box gets the pinned CPU wheel of torch; a GPU box keeps the torch it has (see README).
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC ?= $(if $(HAS_GPU),torch,torch==2.13.0)
PYTEST_ARGS ?=
export TORCHDYNAMO_DISABLE ?= 1
export OMP_NUM_THREADS ?= 1
# Without a GPU, Triton kernels run in its interpreter (the CPU tests of megamoe/backends/triton).
export TRITON_INTERPRET ?= $(if $(HAS_GPU),0,1)

.PHONY: demo demo-data test lint unit integration-infra bench image-cpu clean help

help:  ## list targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(VENV)/.stamp: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.stamp  ## create the virtual environment

# The demo's real text (the Python Language Reference, from CPython's pydoc_data) and its local
# BPE tokenizer, tokenized once into a megatron indexed dataset; later demos reuse it.
DEMO_DATA ?= output/data

$(DEMO_DATA)/pydoc_text_document.idx: examples/data/make_demo_corpus.py | $(VENV)/.stamp
	$(PY) examples/data/make_demo_corpus.py --output $(DEMO_DATA) --vocab-size 2048
	$(VENV)/bin/primus-cli direct -- train prepare-data --input $(DEMO_DATA)/corpus.jsonl \
	  --output-prefix $(DEMO_DATA)/pydoc --tokenizer-type HuggingFaceTokenizer \
	  --tokenizer-model $(DEMO_DATA)/tokenizer --json-keys text --append-eod --workers 2

demo-data: $(DEMO_DATA)/pydoc_text_document.idx  ## prepare the demo's corpus, tokenizer and dataset (once)

demo: $(DEMO_DATA)/pydoc_text_document.idx  ## the main job: train a tiny MoE with MegaMoE on real text, 2 CPU ranks (afresh each time)
	PRIMUS_DATA_DIR=$(DEMO_DATA) GPUS_PER_NODE=$${GPUS_PER_NODE:-2} $(VENV)/bin/primus-cli direct -- \
	  train pretrain --config examples/megatron/configs/cpu/moe_tiny-pretrain.yaml --overwrite_checkpoints True

lint: $(VENV)/.stamp  ## ruff
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

integration-infra:  ## install and start Slurm (munge, slurmctld, 2 slurmd) and podman for the tests
	tests/integration/infra/setup.sh

test: $(VENV)/.stamp lint integration-infra  ## the whole suite (CPU; GPU tests run where a GPU is)
	$(PY) -m pytest $(PYTEST_ARGS)

unit: $(VENV)/.stamp lint  ## the fast loop: no Slurm, no containers, no slow tests; both cores
	$(PY) -m pytest -m "not slow and not slurm and not container" -n 2 --dist loadfile $(PYTEST_ARGS)

bench: $(VENV)/.stamp  ## GPU benchmark of the expert path against torch._grouped_mm
	$(PY) -m benchmarks.bench --mode layer --models DeepSeek-V3,Qwen3-30B-A3B,Qwen3-235B-A22B

image-cpu:  ## build the CPU image (podman or docker)
	images/build.sh cpu

clean:  ## remove the venv and caches
	rm -rf $(VENV) .pytest_cache .ruff_cache

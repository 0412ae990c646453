#!/usr/bin/env bash
# The speculators package (vllm-project/speculators) in a venv of its own, for `make interop`: its pins (transformers
# <= 5.19, datasets <= 5.1) are not ours, so our export is checked by its code without bending our .venv.
#
# speculators goes in with --no-deps: its full list (datasets, openai, torchvision, torchaudio, ...) is for training
# and serving; what `import speculators.models.eagle3` needs at import time is DEPS below (found by trying). torch is
# pinned in every install so pip keeps the local CPU wheel instead of pulling a CUDA build.
# A second run with the same versions only prints them.
set -euo pipefail
VENV=${VENV:-$PWD/.interop/speculators-venv}
SPECULATORS=${SPECULATORS:-0.9.0}
TORCH=torch==2.13.0
# within speculators 0.9.0's own pins; openai, datasets and hs-connectors only because speculators.models.eagle3
# imports its training data module (speculators.train.data) at import time
DEPS=('transformers>=5.0.0,<=5.19.0' 'pydantic>=2.0.0' 'loguru>=0.7.2,<=0.7.3' safetensors huggingface-hub
      'numpy>=2.0.0,<=2.5.4' 'openai>=2.0.0' 'datasets>=4.0.0,<=5.1.0' 'hs-connectors==0.9.0')
PY=$VENV/bin/python
stamp="speculators==$SPECULATORS $TORCH ${DEPS[*]}"

versions() {
  "$PY" -m pip list --format=freeze 2>/dev/null |
    grep -iE '^(speculators|torch|transformers|pydantic|safetensors|huggingface.hub|numpy)==' | tr '\n' ' '
  echo
}

if [[ -f $VENV/.installed && "$(cat "$VENV/.installed")" == "$stamp" ]]; then
  echo "speculators venv up to date ($VENV): $(versions)"; exit 0
fi
start=$(date +%s)
test -x "$PY" || python3 -m venv "$VENV"
"$PY" -m pip install -q "$TORCH"
"$PY" -m pip install -q --no-deps "speculators==$SPECULATORS"
# (pip then lists speculators' requirements left out: expected)
"$PY" -m pip install -q "$TORCH" "${DEPS[@]}"
# a missing import-time dependency fails here, in one line, rather than inside the check
HF_HUB_OFFLINE=1 "$PY" -c "import speculators.models.eagle3, speculators.models.peagle, speculators.models.dflash"
echo "$stamp" >"$VENV/.installed"
echo "speculators venv ready in $(( $(date +%s) - start )) s ($VENV): $(versions)"

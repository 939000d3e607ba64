#!/usr/bin/env bash
# The GPU check of the vLLM rollout engine, run on a lent GPU machine (no internet there).
# Prepare the wheels first, here: `bash bench/gpu_wheels.sh` (prints the calls below). Then,
# back to back (the machine is given back after 30 s idle, with what was staged on it):
#
#   bash bench/gpu_check.sh stage          # once per part, with carry=['.whl/pNN']
#   bash bench/gpu_check.sh install tests  # install the wheels + this repo; the gpu tests
#   bash bench/gpu_check.sh bench          # tokens/s vs vLLM's LLM.generate; weight sync s
#   bash bench/gpu_check.sh rl lora        # a short RL job on the mesh, LoRA ...
#   bash bench/gpu_check.sh rl full        # ... and full fine-tuning: step time split
#   bash bench/gpu_check.sh multilora      # k jobs' LoRAs on one vLLM engine: tokens/s
#
# Each step ends with "GPU CHECK <step>: PASSED" or "GPU CHECK <step>: FAILED (<what>)" and
# the lines that say why; logs also go to $OUT (they come back with the call).
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE=/tmp/opentinker-whl
SITE=/tmp/opentinker-site
MODEL=/tmp/opentinker-qwen2.5-0.5b-shape  # built once by `install`; vLLM's compile cache follows it
OUT=${OUT:-/tmp/opentinker-out}
mkdir -p "$OUT"
touch "$OUT/.started"  # logs newer than this are this call's
# flashinfer is not carried (vLLM falls back to its own sampler and FlashAttention 3)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export VLLM_USE_FLASHINFER_SAMPLER=0
export PYTHONUNBUFFERED=1 PYTHONPATH="$SITE/ot:$SITE/deps${PYTHONPATH:+:$PYTHONPATH}"

passed() { echo "GPU CHECK $1: PASSED"; }
failed() {
  echo "GPU CHECK $1: FAILED ($2)"
  exit 1
}

stage() {
  mkdir -p "$STAGE"
  local found=0
  for dir in .whl/p[0-9]*; do
    [ -d "$dir" ] || continue
    cp "$dir"/* "$STAGE"/ && found=1
  done
  [ "$found" = 1 ] || failed stage "no .whl/pNN here: pass carry=['.whl/pNN']"
  echo "staged: $(ls "$STAGE" | tr '\n' ' ')"
  passed stage
}

install() {
  [ -f "$STAGE/MANIFEST" ] || failed install "part p00 (with MANIFEST) was not staged"
  # shellcheck disable=SC1091
  . "$STAGE/MANIFEST"
  local have
  have=$(ls "$STAGE"/part-* 2>/dev/null | wc -l)
  [ "$have" = "$parts" ] || failed install "$have of $parts parts staged: $(ls "$STAGE" | tr '\n' ' ')"
  [ "$(cat "$STAGE"/part-* | sha256sum | cut -d' ' -f1)" = "$sha256" ] ||
    failed install "the staged parts do not add up (sha256); stage them again"
  rm -rf "$STAGE/dl" "$SITE" && mkdir -p "$STAGE/dl" "$SITE"
  cat "$STAGE"/part-* | tar -xf - -C "$STAGE/dl" || failed install "tar"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE/deps" "$STAGE"/dl/*.whl 2>&1 | tail -5
  [ "${PIPESTATUS[0]}" = 0 ] || failed install "pip install of the wheels"
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
    --target "$SITE/ot" . 2>&1 | tail -5
  [ "${PIPESTATUS[0]}" = 0 ] || failed install "pip install of this repo"
  python3 - <<'PY' || failed install "imports (a ModuleNotFoundError names a wheel to add to bench/gpu_wheels.txt)"
import torch, vllm, transformers, peft, opentinker.services.rollout.vllm_engine as e
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
print("vllm", vllm.__version__, "transformers", transformers.__version__, "peft", peft.__version__)
from vllm import LLM, SamplingParams  # the lazy names resolve
PY
  python3 -m opentinker.services.modeling.tiny_model --shape qwen2.5-0.5b --out "$MODEL" ||
    failed install "building the 0.5B-shaped model"
  passed install
}

tests() {
  # Every test file holding a `gpu` test (grep -l "mark.gpu" tests/*.py): the marker alone
  # over tests/ would import every module, some of them needing packages the image lacks.
  OPENTINKER_GPU_TEST_MODEL="$MODEL" python3 -m pytest -q -rA -s -p no:cacheprovider -m gpu tests/test_vllm_engine_gpu.py \
    tests/test_vllm_multi_lora_gpu.py tests/test_rollout_engine.py tests/test_prefix_cache.py \
    tests/test_weight_transport.py tests/test_checkpoints.py 2>&1 | tee "$OUT/gpu_tests.log"
  [ "${PIPESTATUS[0]}" = 0 ] || failed tests "pytest, see above"
  ! grep -q "^SKIPPED" "$OUT/gpu_tests.log" || failed tests "a gpu test was skipped, the reason above"
  passed tests
}

bench() {
  python3 bench/vllm_engine.py --model "$MODEL" "$@" 2>&1 | tee "$OUT/vllm_engine.log" | grep -v "^INFO\|^DEBUG"
  [ "${PIPESTATUS[0]}" = 0 ] || failed bench "bench/vllm_engine.py (try: bench --eager)"
  passed bench
}

multilora() {
  python3 bench/multi_lora.py --engine vllm --model "$MODEL" --ks 1,4,16 --prompts 8 \
    --new-tokens 64 --rounds 3 2>&1 | tee "$OUT/multi_lora.log" | grep -v "^INFO\|^DEBUG"
  [ "${PIPESTATUS[0]}" = 0 ] || failed multilora "bench/multi_lora.py --engine vllm, see above"
  passed multilora
}

rl() {
  local finetune=${1:-lora}
  python3 bench/gpu_rl.py --finetune "$finetune" --model "$MODEL" 2>&1 | tee "$OUT/rl_$finetune.log"
  if [ "${PIPESTATUS[0]}" != 0 ]; then
    local log why
    for log in $(find /tmp/opentinker-gpu-rl-* -path "*/logs/*.log" -newer "$OUT/.started"); do
      echo "--- tail $log" && tail -8 "$log"
    done
    for log in $(find /tmp/opentinker-gpu-rl-* -path "*/jobs/*.log" -newer "$OUT/.started" | sort); do
      echo "--- tail $log" && tail -30 "$log"  # the job's rollout and trainer: last, nearest
    done
    why=$(grep -o "JobFailedError: .*\|Error: .*" "$OUT/rl_$finetune.log" | tail -1 | cut -c1-400)
    failed "rl $finetune" "${why:-the job, logs above}; if vLLM failed inside the rollout process, try OPENTINKER_ROLLOUT_VLLM_IN_PROCESS=false bash bench/gpu_check.sh rl $finetune"
  fi
  passed "rl $finetune"
}

[ $# -gt 0 ] || set -- install tests
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null
while [ $# -gt 0 ]; do
  case "$1" in
    stage) stage ;;
    install) install ;;
    tests) tests ;;
    bench) bench ;;
    rl) rl "${2:-lora}"; shift ;;
    multilora) multilora ;;
    *) failed "$1" "unknown step; use stage, install, tests, bench, rl lora|full, multilora" ;;
  esac
  shift
done

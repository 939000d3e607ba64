#!/usr/bin/env bash
# The GPU check of the vLLM rollout engine, run on a lent GPU machine (no internet there).
# Prepare the wheels first, here: `bash bench/gpu_wheels.sh` (prints the calls below). A
# session has 15 device minutes in all, and the machine goes back after 30 s idle with what
# was staged on it, so the calls go back to back, most important first:
#
#   bash bench/gpu_check.sh stage                   # carry=['.whl/p00'] ... one part a call
#   bash bench/gpu_check.sh stage install bench multilora
#                                                   # the last part; tokens/s vs LLM.generate
#                                                   # seeded and not; k adapters on one engine
#   GPU_CHECK_STEP_LIMIT_S=200 bash bench/gpu_check.sh rl full tests weight_transport,rollout_engine,prefix_cache,checkpoints,memory_metrics
#                                                   # a full RL job that trains; GPU tests
#   bash bench/gpu_check.sh rl lora tests vllm_multi_lora_gpu,vllm_engine_gpu
#                                                   # if time is left
#
# On an H100 (2026-11-27, the fourth lease) the five stages took 64 s of device time, the
# second call 504 s, the third 222 s: all passed, 862 of a session's 900 s.
# (`tests` alone runs every file; gpu_wheels.sh prints this plan with the carries.)
#
# Each step ends with "GPU CHECK <step>: PASSED" or "GPU CHECK <step>: FAILED (<what>)" and
# the lines that say why; logs also go to $OUT (they come back with the call). A failed step
# does not stop the ones after it (except stage and install, which all others need), and each
# step is cut at its time limit (`limit_s` below, or GPU_CHECK_STEP_LIMIT_S for all), so one
# hang cannot take the whole call: the combined calls above stay under a call's 600 s. The last line sums up: "GPU CHECK SUMMARY: passed ...; failed ...".
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

limit_s() {  # seconds a step may take
  if [ -n "${GPU_CHECK_STEP_LIMIT_S:-}" ]; then echo "$GPU_CHECK_STEP_LIMIT_S" && return; fi
  case "$1" in stage) echo 60 ;; install) echo 180 ;; tests) echo 330 ;; *) echo 270 ;; esac
}

passed() { echo "GPU CHECK $1: PASSED"; }
failed() {  # ends the step (each runs in a subshell), not the check
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
  python3 bench/gpu_imports.py vllm.entrypoints.llm vllm.v1.engine.core \
    opentinker.services.rollout.engines.vllm_engine opentinker.services.rollout.engines.vllm_multi_lora ||
    failed install "imports: add the missing modules' wheels to bench/gpu_wheels.txt"
  python3 - <<'PY' || failed install "imports"
import torch, vllm, transformers, peft
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
print("vllm", vllm.__version__, "transformers", transformers.__version__, "peft", peft.__version__)
from vllm import LLM, SamplingParams  # the lazy names resolve
PY
  python3 -m opentinker.services.modeling.tiny_model --shape qwen2.5-0.5b --out "$MODEL" ||
    failed install "building the 0.5B-shaped model"
  passed install
}

# Every file holding a `gpu` test (tests/project/test_benches.py checks).
GPU_TEST_FILES="tests/rollout/test_vllm_engine_gpu.py tests/rollout/test_vllm_multi_lora_gpu.py
  tests/rollout/test_rollout_engine.py tests/rollout/test_prefix_cache.py
  tests/trainer/test_weight_transport.py tests/trainer/test_checkpoints.py
  tests/trainer/test_memory_metrics.py"

tests() {
  # One pytest per file, each with its own log in $OUT, so the files that ran keep their
  # result when a later one hangs; `tests vllm_engine_gpu,checkpoints` runs only those. Files
  # are named (not `-m gpu` over tests/): the others import packages the image lacks.
  local files=() file stem bad=()
  if [ -n "${1:-}" ]; then
    for stem in ${1//,/ }; do  # tests/<group>/test_<stem>.py
      file=$(ls tests/*/test_"$stem".py 2>/dev/null | head -1)
      files+=("${file:-tests/test_$stem.py}")
    done
  else
    read -ra files <<<"$(echo $GPU_TEST_FILES)"
  fi
  for file in "${files[@]}"; do
    [ -f "$file" ] || failed tests "no $file"
    stem=$(basename "$file" .py)
    echo "--- $file"
    OPENTINKER_GPU_TEST_MODEL="$MODEL" python3 -m pytest -q -rA -s -p no:cacheprovider -m gpu \
      "$file" 2>&1 | tee "$OUT/gpu_$stem.log" | grep -v "^INFO\|^DEBUG\|^(EngineCore"
    [ "${PIPESTATUS[0]}" = 0 ] || bad+=("$stem")
    ! grep -q "^SKIPPED" "$OUT/gpu_$stem.log" || bad+=("$stem (a gpu test skipped, the reason above)")
  done
  [ ${#bad[@]} = 0 ] || failed tests "${bad[*]}"
  passed tests
}

bench() {
  python3 bench/vllm_engine.py --model "$MODEL" "$@" 2>&1 | tee "$OUT/vllm_engine.log" | grep -v "^INFO\|^DEBUG"
  [ "${PIPESTATUS[0]}" = 0 ] || failed bench "bench/vllm_engine.py (try: bench --eager)"
  passed bench
}

multilora() {
  # --eager: no LoRA CUDA graphs to capture at start (minutes of a 15-minute lease); both
  # sides of the comparison run eager alike. Sized to end in about 2 minutes: a decode step
  # took about 67 ms whatever the rows (H100, 2026-11-27), and one job per call at k=16 is 16
  # calls a round (64 tokens x 3 rounds + a warm-up each did not end in 230 s)
  python3 bench/multi_lora.py --engine vllm --eager --model "$MODEL" --ks 1,4,16 --prompts 8 \
    --new-tokens 32 --rounds 2 2>&1 | tee "$OUT/multi_lora.log" | grep -v "^INFO\|^DEBUG"
  [ "${PIPESTATUS[0]}" = 0 ] || failed multilora "bench/multi_lora.py --engine vllm, see above"
  passed multilora
}

rl() {
  local finetune=${1:-lora}
  python3 bench/gpu_rl.py --finetune "$finetune" --model "$MODEL" 2>&1 | tee "$OUT/rl_$finetune.log"
  local rc=${PIPESTATUS[0]} log why
  # The job's rollout log comes back whole (vLLM's start is most of the job's first minutes)
  for log in $(find /tmp/opentinker-gpu-rl-* -path "*/jobs/*/rollout.log" -newer "$OUT/.started"); do
    cp "$log" "$OUT/rl_${finetune}_rollout.log"
  done
  if [ "$rc" != 0 ]; then
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

# What a step left running: the mesh's services run in process sessions of their own (so
# the step's timeout does not reach them), and left alive they (vLLM's engine core too) would
# hold GPU memory that the next step needs. Every process the step started inherits its
# GPU_CHECK_STEP mark, so the sweep finds exactly those, whatever their session or name.
step_processes() {
  grep -lszxF "GPU_CHECK_STEP=$1" /proc/[0-9]*/environ | cut -d/ -f3  # the whole variable, literally
}
sweep() {
  local pids
  pids=$(step_processes "$1")
  [ -n "$pids" ] || return 0
  kill -TERM $pids 2>/dev/null
  sleep 3
  pids=$(step_processes "$1")
  [ -z "$pids" ] || kill -KILL $pids 2>/dev/null
  echo "GPU CHECK: ended the processes the step left"
}

# One step in a subshell under its time limit: `timeout` sends TERM to the step's process
# group (the step's pytest or bench, and the pipes), then the sweep takes the rest.
run_step() {
  local name=$1 limit mark
  shift
  limit=$(limit_s "$1")
  mark="$$.$RANDOM.$1"
  local started=$SECONDS
  GPU_CHECK_STEP=$mark timeout -k 10 "$limit" bash "$0" --one "$@"
  local rc=$?
  [ "$rc" = 124 ] && echo "GPU CHECK $name: FAILED (over its $limit s limit)"
  sweep "$mark"
  echo "GPU CHECK $name: took $((SECONDS - started)) s"  # to plan the next lease's calls
  return "$rc"
}

if [ "${1:-}" = --one ]; then  # inside run_step
  shift
  case "$1" in
    stage) stage ;;
    install) install ;;
    tests) tests "${2:-}" ;;
    bench) bench ;;
    rl) rl "${2:-lora}" ;;
    multilora) multilora ;;
  esac
  exit
fi

[ $# -gt 0 ] || set -- install tests
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null
passed_steps=() failed_steps=()
while [ $# -gt 0 ]; do
  step=$1 args=("$1")
  if [ "$1" = rl ]; then
    case "${2:-}" in lora | full) step="rl $2" args=(rl "$2") && shift ;; *) step="rl lora" args=(rl lora) ;; esac
  elif [ "$1" = tests ]; then  # an optional list of files: tests vllm_engine_gpu,checkpoints
    case "${2:-}" in "" | stage | install | tests | bench | rl | multilora) ;; *) step="tests $2" args=(tests "$2") && shift ;; esac
  fi
  shift
  case "${args[0]}" in
    stage | install | tests | bench | rl | multilora) run_step "$step" "${args[@]}" ;;
    *) echo "GPU CHECK $step: FAILED (unknown step; use stage, install, tests, bench, rl lora|full, multilora)" && false ;;
  esac
  if [ $? = 0 ]; then
    passed_steps+=("$step")
  else
    failed_steps+=("$step")
    case "$step" in stage | install) echo "GPU CHECK: the steps after $step need it; stopping" && break ;; esac
  fi
done
echo "GPU CHECK SUMMARY: passed ${passed_steps[*]:-none}; failed ${failed_steps[*]:-none}"
[ ${#failed_steps[@]} = 0 ]

#!/usr/bin/env bash
# Run on a machine that reaches PyPI (a developer's), in the repo root, BEFORE the GPU calls:
# downloads bench/gpu_wheels.txt for the GPU machine (Python 3.12, x86-64 Linux) into
# .whl/dl and splits them into parts of at most 56 MiB, .whl/p00 ... .whl/pNN: one part per
# `run` call, since one call carries at most 64 MiB with the working tree
# (/work/.library/device/README.md). Prints the calls to make. See bench/gpu_check.sh.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
mkdir -p .whl/dl
git check-ignore -q .whl/dl || { echo "/.whl/ must be ignored (.gitignore)"; exit 1; }
grep -v '^#' bench/gpu_wheels.txt | grep -v '^ *$' >.whl/requirements.txt
platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d .whl/dl -r .whl/requirements.txt
# Complete before any device time: every requirement carried, in the image or omitted
python3 bench/gpu_wheels_closure.py .whl/dl .whl/requirements.txt
rm -rf .whl/p[0-9]* .whl/part-*
tar -C .whl/dl -cf - . | split -b 56m -d -a 2 - .whl/part-
parts=0
total=$(ls .whl/part-* | wc -l)
sum=$(cat .whl/part-* | sha256sum | cut -d' ' -f1)
for part in .whl/part-*; do
  name="p${part##*-}"
  mkdir -p ".whl/$name" && mv "$part" ".whl/$name/"
  parts=$((parts + 1))
done
printf 'parts=%s\nsha256=%s\n' "$total" "$sum" >.whl/p00/MANIFEST  # checked there
echo "$(du -sh .whl/dl | cut -f1) of wheels in $parts parts. On the GPU machine, back to back"
echo "(it is given back after 30 s idle, and the staged parts with it; 15 device minutes in all):"
last=$(ls -d .whl/p[0-9]* | tail -1)
for dir in .whl/p[0-9]*; do
  [ "$dir" = "$last" ] && break
  echo "  run(command='bash bench/gpu_check.sh stage', carry=['$dir'])"
done
# In calls of a few minutes each: a call that loses its machine loses its output. Step times
# on an H100: 2026-11-26, install 100 s, rl full 115 s, bench 142 s, weight_transport 38 s;
# 2026-11-27 (one call of 532 s: stage, install and rl lora together ~355 s, the job 213 s of
# it with vLLM's compile cache cold; tests vllm_multi_lora_gpu 88 s and vllm_engine_gpu 74 s
# (the step 175 s); all passed); the fourth lease, 2026-11-27: install 103 s, bench 216 s,
# multilora (k = 1, 4, 16) 184 s, rl full 103 s, the four other test files 119 s; all passed.
# The third call gets what the second leaves (~320 s): each step is cut at 200 s, so that a
# hang in one leaves the other its time (rl full took 103 s with vLLM's compile cache warm).
echo "  run(command='bash bench/gpu_check.sh stage install bench multilora', carry=['$last'], timeout_s=600)"
echo "  run(command='GPU_CHECK_STEP_LIMIT_S=200 bash bench/gpu_check.sh rl full tests weight_transport,rollout_engine,prefix_cache,checkpoints,memory_metrics', timeout_s=310)"
echo "  run(command='bash bench/gpu_check.sh rl lora tests vllm_multi_lora_gpu,vllm_engine_gpu', timeout_s=600)  # in a later lease, or if time is left"

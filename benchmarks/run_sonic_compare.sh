#!/usr/bin/env bash
# The layer bench with SonicMoE beside MegaMoE and the torch pipeline, on one H200 (Python 3.12, torch
# 2.11, triton 3.6 installed, no network): installs SonicMoE from carried wheels, checks it imports,
# then runs one bench step per model, both routings, each under its own timeout.
#
#   benchmarks/run_sonic_compare.sh [MODEL ...]   # from the checkout's root; default: all three models
#
# PEER (default .peer, git-ignored) holds sonic-moe 0.1.2.post1, quack-kernels 0.4.1,
# nvidia-cutlass-dsl 4.4.2, apache-tvm-ffi and torch-c-dlpack-ext as wheels and
# nvidia-cutlass-dsl-libs-base 4.4.2 unpacked in libs_base.tar.xz. Each model writes
# $OUT/layer-sonic-<model>.json (bench --json) and .log.
#
# SonicMoE's six QuACK GEMMs autotune on a shape's first call: every candidate tile config is
# compiled (QUACK_COMPILE_WORKERS processes, here one per core) and timed, minutes per model. The
# choices are kept on disk (QUACK_CACHE_AUTOTUNING=1) and packed after every step, finished or not,
# into $OUT/quack-autotune.tar.gz; put that file in PEER (or over benchmarks/results/
# sonic-quack-autotune.tar.gz) and the next run, on a fresh machine too, compiles only the
# chosen configs. Where a call is limited to 10 minutes, run one model per call.
# TIMELINE=1 also writes each model's per-kernel timeline of MegaMoE and of SonicMoE (first routing
# only; python -m benchmarks.profile_layer --impl megamoe|sonic) to $OUT/timeline-<impl>-<model>.md.
# BENCH=0 skips the timed bench (timelines only). Other settings: ROUTING (default uniform,skewed),
# STEP_TIMEOUT_S (default 540), SITE (where the wheels go, default /tmp/site), PYTHON (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
peer=${PEER:-.peer}
out=${OUT:-output/sonic_compare}
site=${SITE:-/tmp/site}
py=${PYTHON:-python3}
step_s=${STEP_TIMEOUT_S:-540}
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(DeepSeek-V3 Qwen3-30B-A3B Qwen3-235B-A22B)

mkdir -p "$out" "$site"
timeout 300 tar -xJf "$peer/libs_base.tar.xz" -C "$site" &&
  timeout 300 "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$peer"/*.whl ||
  { echo "installing SonicMoE's wheels from $peer failed" >&2; exit 1; }
# the cutlass DSL's .pth file is not read from a --target folder, hence its second path
export PYTHONPATH="$site:$site/nvidia_cutlass_dsl/python_packages${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export QUACK_CACHE_AUTOTUNING=1 QUACK_CACHE_DIR=${QUACK_CACHE_DIR:-/tmp/quack_cache}
export QUACK_COMPILE_WORKERS=${QUACK_COMPILE_WORKERS:-$(nproc)}
mkdir -p "$QUACK_CACHE_DIR"
# the tuning an earlier run packed: PEER's, else the one kept with the results (partial: the H200's
# DeepSeek-V3 and Qwen3-235B-A22B, an H100's Qwen3-30B-A3B)
for tuning in "$peer/quack-autotune.tar.gz" benchmarks/results/sonic-quack-autotune.tar.gz; do
  if [ -f "$tuning" ]; then
    tar -xzf "$tuning" -C "$QUACK_CACHE_DIR" && echo "restored SonicMoE's tuning from $tuning"
    break
  fi
done
timeout 300 "$py" -c 'import sonicmoe; print("sonicmoe", sonicmoe.__version__, "imports")' ||
  { echo "sonicmoe does not import after the install" >&2; exit 1; }

status=0
routings=${ROUTING:-uniform,skewed}
for model in "${models[@]}"; do
  if [ "${BENCH:-1}" != 0 ]; then
    timeout "$step_s" "$py" -m benchmarks.bench --mode layer --models "$model" --routing "$routings" \
      --baseline torch,sonic --json "$out/layer-sonic-$model.json" 2>&1 | tee "$out/layer-sonic-$model.log" ||
      { echo "$model: the bench step failed or ran past ${step_s} s" >&2; status=1; }
  fi
  if [ "${TIMELINE:-0}" = 1 ]; then
    for impl in megamoe sonic; do
      timeout "$step_s" "$py" -m benchmarks.profile_layer --model "$model" --routing "${routings%%,*}" \
        --impl "$impl" 2>&1 | tee "$out/timeline-$impl-$model.md" ||
        { echo "$model: the $impl timeline failed or ran past ${step_s} s" >&2; status=1; }
    done
  fi
  (cd "$QUACK_CACHE_DIR" && find . -name '*.autotune.json' | tar -czf "$out/quack-autotune.tar.gz" -T -)
done
exit $status

#!/usr/bin/env bash
# The GPU figures of docs/cluster.md#gpu, on a machine with one CUDA GPU, from the repository root:
#   [STEPS="in_memory loop tests offload resident"] bash benchmarks/gpu_figures.sh [OUT_DIR]
# Steps, in this order, those named in STEPS (default "in_memory tests resident": ~9-10 minutes on
# an H200, about one call's 10-minute limit: on a warm machine, STEPS="in_memory tests" in one call
# and STEPS=resident in the next is safer; loop and offload take ~3-4 more each):
#   in_memory  bench_loop.py at ~0.97B parameters (base_model.size=1b) in bf16 with fp32 masters,
#              ZeRO 0 and 3, with optimize.policy_weights=with_train_state (nothing written in the
#              measured iterations), with the share of each iteration the GPU was busy;
#   loop       the same with every policy written (the default), the baseline on the same machine;
#   tests      the tests marked `gpu`;
#   offload    bench_memory's offload case at 1b (ZeRO-3 with and without CPU offload);
#   resident   bench_loop with resident workers sharing GPU 0 (the policy handed over on the GPU:
#              stages/common/device_weights.py).
# Logs and the figures' JSON go to OUT_DIR ($OUT, else /tmp/gpu_figures).
#
# A machine without rlpipe's dependencies but with CUDA torch and transformers (ours, which reaches
# no package index) takes them from .whl/site.tar.xz: the wheels unpacked into one folder and
# xz-compressed, made on a machine with an index (commands in docs/cluster.md#gpu).
set -u
out=${1:-${OUT:-/tmp/gpu_figures}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
step() { echo "== $(date +%T) $*"; }

if [ -f .whl/site.tar.xz ]; then
  step "unpacking .whl/site.tar.xz"
  tar xJf .whl/site.tar.xz -C /tmp || exit 1
  export PYTHONPATH=/tmp/site
fi
step "installing rlpipe (no dependencies)"
python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/rlpipe . || exit 1
export PYTHONPATH=/tmp/rlpipe${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 - <<'EOF' || exit 1
import deepspeed, polars, pyarrow, pydantic, torch, transformers
import rlpipe.pipelines.runner  # noqa: F401
print(f"torch {torch.__version__}, transformers {transformers.__version__}, deepspeed {deepspeed.__version__}, "
      f"pyarrow {pyarrow.__version__}, polars {polars.__version__}, pydantic {pydantic.__version__}; "
      f"CUDA {torch.cuda.is_available()}: {torch.cuda.get_device_name(0)}")
EOF
df -h /tmp | tail -1

steps=" ${STEPS:-in_memory tests resident} "
runs() { [[ "$steps" == *" $1 "* ]]; }
# (each bench_loop at 1b takes ~95 s on an H200, most of it building two 1B models on the CPU; the
# first on a fresh machine ~15 s more)
bench_1b() {  # NAME ZERO [override ...]
  local name=$1 zero=$2; shift 2
  step "bench_loop 1b ZeRO $zero ($name)"
  timeout "${BENCH_TIMEOUT_S:-150}" python3 benchmarks/bench_loop.py --sizes 1b --launchers local \
    --iterations "${ITERATIONS:-3}" --warmup 1 --threads 8 --json "$out/bench_loop_1b_${name}_zero$zero.json" \
    "optimize.zero_stage=$zero" "$@" 2>&1 | grep -v 'it/s, elapsed' | tee "$out/bench_loop_1b_${name}_zero$zero.log"
}

if runs in_memory; then
  for zero in 0 3; do bench_1b in_memory "$zero" optimize.policy_weights=with_train_state; done
fi
if runs loop; then
  for zero in 0 3; do bench_1b written "$zero"; done
fi
if runs tests; then
  step "pytest -m gpu"
  timeout "${TESTS_TIMEOUT_S:-150}" python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tee "$out/pytest_gpu.log"
fi
if runs offload; then
  step "bench_memory offload 1b (ZeRO-3, optimizer state and parameters in host memory or not)"
  timeout "${OFFLOAD_TIMEOUT_S:-240}" python3 benchmarks/bench_memory.py --cases offload --offload-size 1b \
    --json "$out/bench_memory_offload_1b.json" 2>&1 | tee "$out/bench_memory_offload_1b.log"
fi
if runs resident; then
  step "bench_loop 1b ZeRO 0, resident workers sharing GPU 0"
  timeout "${RESIDENT_TIMEOUT_S:-230}" python3 benchmarks/bench_loop.py --sizes 1b --launchers resident \
    --iterations "${ITERATIONS:-3}" --warmup 1 --threads 8 --json "$out/bench_loop_1b_resident.json" \
    2>&1 | grep -v 'it/s, elapsed' | tee "$out/bench_loop_1b_resident.log"
fi
step done

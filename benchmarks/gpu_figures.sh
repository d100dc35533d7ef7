#!/usr/bin/env bash
# The GPU figures of docs/cluster.md#gpu, on a machine with one CUDA GPU, from the repository root:
#   bash benchmarks/gpu_figures.sh [OUT_DIR]
# bench_loop.py at ~0.97B parameters (base_model.size=1b) in bf16 with fp32 masters, ZeRO 0 and 3,
# with the share of each iteration the GPU was busy; then the tests marked `gpu`; then bench_memory's
# offload case at 1b (ZeRO-3 with and without CPU offload); then bench_loop with resident workers. Logs and the
# figures' JSON go to OUT_DIR ($OUT, else /tmp/gpu_figures).
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

for zero in 0 3; do
  step "bench_loop 1b ZeRO $zero"
  timeout "${BENCH_TIMEOUT_S:-230}" python3 benchmarks/bench_loop.py --sizes 1b --launchers local \
    --iterations "${ITERATIONS:-3}" --warmup 1 --threads 8 --json "$out/bench_loop_1b_zero$zero.json" \
    "optimize.zero_stage=$zero" 2>&1 | tee "$out/bench_loop_1b_zero$zero.log"
done

step "pytest -m gpu"
timeout "${TESTS_TIMEOUT_S:-150}" python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tee "$out/pytest_gpu.log"

step "bench_memory offload 1b (ZeRO-3, optimizer state and parameters in host memory or not)"
timeout "${OFFLOAD_TIMEOUT_S:-200}" python3 benchmarks/bench_memory.py --cases offload --offload-size 1b \
  --json "$out/bench_memory_offload_1b.json" 2>&1 | tee "$out/bench_memory_offload_1b.log"

step "bench_loop 1b ZeRO 0, resident workers sharing GPU 0"
timeout "${RESIDENT_TIMEOUT_S:-230}" python3 benchmarks/bench_loop.py --sizes 1b --launchers resident \
  --iterations "${ITERATIONS:-3}" --warmup 1 --threads 8 --json "$out/bench_loop_1b_resident.json" \
  2>&1 | tee "$out/bench_loop_1b_resident.log"
step done

#!/bin/bash
# The device check in one call (issue 4's CUDA path): run on a GPU machine from the repo root,
# with the wheels that machine lacks in .whl/ (README "On a GPU"). Make them here, once:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl pulp==3.3.2 highspy==1.16.0
#   1. installs them and remat into /tmp/site (no network there),
#   2. the CUDA tests of tests/test_executor.py and tests/test_native.py,
#   3. benchmarks/gpu_swap_timeline.py (the swap test's plans op by op),
#   4. benchmarks/gpu_check.py --timeline (plans on CUDA against max_memory_allocated, step times,
#      and op-by-op bytes), then again at batch 256 (gpu_check_big.csv: step times with larger kernels),
#   5. benchmarks/executor_speed.py on CUDA (native execution against the interpreter and plain), and
#      with --granularity joint (op-level plans as straight-line code against the interpreter and plain),
#   6. the default suite on 14 workers, to see what differs with a GPU present,
#   7. with T_COMPILED > 0 (default 0: the files that come back are 8 at most), remat.compiler against
#      torch.compile's activation_memory_budget on CUDA (benchmarks/peers.py --case mlp, inductor).
# Every part has its own time cap (T_TESTS, T_SWAP, T_CHECK, T_BIG, T_NATIVE, T_JOINT, T_SUITE seconds; 0
# skips the swap timeline, the large batch, the native or joint comparison or the suite); the log is device.log, figures beside it, in $OUT
# (default benchmarks/out/device): at most 8 files, what the device tool brings back.
# The defaults add up to about 9 minutes with the install (the large batch off): within one device call of 10.
set -u
OUT=${OUT:-benchmarks/out/device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T_TESTS=${T_TESTS:-90}
T_SWAP=${T_SWAP:-90}
T_CHECK=${T_CHECK:-120}
T_BIG=${T_BIG:-0}
T_SUITE=${T_SUITE:-40}
T_NATIVE=${T_NATIVE:-90}
T_JOINT=${T_JOINT:-90}
T_COMPILED=${T_COMPILED:-0}
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start )) s] $*"; }

stamp install
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheels did not install"; exit 1; }
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site . \
  || { echo "remat did not install"; exit 1; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, pulp, remat; print('torch', torch.__version__, torch.cuda.get_device_name(), 'pulp', pulp.__version__)"
} 2>&1 | tee "$OUT/device.log"

stamp "CUDA tests"
timeout "$T_TESTS" python3 -m pytest -p no:cacheprovider -q -rs --show-capture=no tests/test_executor.py \
  tests/test_native.py -k cuda 2>&1 | tee -a "$OUT/device.log"

if [ "$T_NATIVE" -gt 0 ]; then
stamp "native against the interpreter and plain autograd (short GPU steps)"
timeout "$T_NATIVE" python3 benchmarks/executor_speed.py --device cuda --cases gpt2,resnet50 --steps 9 \
  --out "$OUT/executor_speed_cuda.csv" 2>&1 | tee -a "$OUT/device.log"
fi

if [ "$T_JOINT" -gt 0 ]; then
stamp "op-level plans: straight-line code against the interpreter and plain autograd"
timeout "$T_JOINT" python3 benchmarks/executor_speed.py --device cuda --granularity joint --cases gpt2,resnet50 \
  --steps 9 --time-limit 10 --out "$OUT/executor_speed_joint_cuda.csv" 2>&1 | tee -a "$OUT/device.log"
fi

if [ "$T_SWAP" -gt 0 ]; then
stamp "swap timeline"
timeout "$T_SWAP" python3 benchmarks/gpu_swap_timeline.py --out "$OUT" 2>&1 | tee -a "$OUT/device.log"
fi

stamp gpu_check
timeout "$T_CHECK" python3 benchmarks/gpu_check.py --out "$OUT" ${GPU_CHECK_ARGS:---time-limit 8 --threads 4 --timeline} \
  2>&1 | tee -a "$OUT/device.log"

if [ "$T_BIG" -gt 0 ]; then
stamp "gpu_check, large batch (time where kernels, not launches, take it)"
timeout "$T_BIG" python3 benchmarks/gpu_check.py --out "$OUT" --tag _big --batch 256 --budgets 1.0,0.5 \
  --models resnet18,gpt2 --time-limit 8 --threads 4 2>&1 | tee -a "$OUT/device.log"
fi

if [ "$T_SUITE" -gt 0 ]; then
stamp "default suite"
# -v: one line a test as it ends, so a run cut by its time cap still says which failed
timeout "$T_SUITE" python3 -m pytest -p no:cacheprovider -v --tb=short --show-capture=no -n 14 \
  -m "not slow and not notebooks" > "$OUT/suite.log" 2>&1
grep -E "FAILED|ERROR|passed|failed" "$OUT/suite.log" | tail -30
fi
if [ "$T_COMPILED" -gt 0 ]; then
stamp "remat.compiler against torch.compile's memory budget (CUDA, inductor)"
timeout "$T_COMPILED" python3 benchmarks/peers.py --case mlp --device cuda --only-compile --remat-compiled --inductor \
  --budgets 0.5,0.9 --solvers dp --steps 7 --time-limit 8 -o "$OUT/peers-mlp-compiled-cuda.csv" 2>&1 | tee -a "$OUT/device.log"
fi
stamp done

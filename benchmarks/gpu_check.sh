#!/usr/bin/env bash
# One pass of every check that needs a GPU: the CUDA tests, then the CUDA benchmarks, each capped.
#   bash benchmarks/gpu_check.sh [OUT_DIR]     # from the repository root, on a machine with CUDA
# Uses the Python that holds torch (python3); missing pure-Python packages can come as wheels in .whl/.
# Output goes to OUT_DIR (default ./gpu_out): test_cuda.txt, bench_fast_cuda.txt, gpu_mfu.txt, ...
set -uo pipefail
OUT_DIR=${1:-gpu_out}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'bf16', torch.cuda.is_bf16_supported(), 'transformers', transformers.__version__)"
    nproc
} 2>&1 | tee "$OUT_DIR/machine.txt"
run() {  # name, seconds, command...
    local name=$1 secs=$2; shift 2
    echo "== $name (cap ${secs}s)"
    local t0=$SECONDS
    timeout "$secs" "$@" >"$OUT_DIR/$name.txt" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - t0))s"
    tail -n 40 "$OUT_DIR/$name.txt"
}
run test_cuda 170 python3 -m pytest -q -p no:cacheprovider -x tests/test_cuda.py
run bench_fast_cuda 150 python3 benchmarks/bench_fast.py --device cuda --repeats 7
run gpu_mfu 130 python3 benchmarks/gpu.py
run bench_generate_cuda 80 python3 benchmarks/bench_generate.py --device cuda --new 128 --repeats 3 --uncached-repeats 1

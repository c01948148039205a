#!/usr/bin/env bash
# Everything a lent GPU checks, in one call: the CUDA tests, then the GPU benchmarks, each under a time limit
# so that the call ends inside the device's limit and keeps what finished.
#
#   PYTHONPATH=. bash bench/on_gpu.sh OUT [COMMIT] [TRUTH_S] [gpu_truth.py's --only regular expressions...]
#
# OUT receives pytest.txt, the benchmarks' JSON (named as under bench/results/) and traces.tgz (the measured
# timelines of gpu_truth's runs); COMMIT is the commit measured (a device machine's copy of the tree can hold
# a stale HEAD); TRUTH_S is gpu_truth's --deadline (default 300). Run by `device run` as
#   bash bench/on_gpu.sh "$OUT" <commit>
# then copy the JSON into bench/results/ (gpu_truth's into bench/results/gpu/). On an H200 (2026-11-27) the CUDA
# tests took 47 s, the vocabulary head 10 s, compile.py on gpt-125m 32 s, gpu_truth's profile 17 s and each
# run 20-50 s (7 runs: 214 s), executor_overhead on gpt-125m 22 s: 325 s in all. Every run of gpu_truth in
# one call (14) would take it past 8 minutes: pick with --only, and take the rest in a second call at once
# while the machine is warm (30 s).
set -u
out=${1:?usage: bench/on_gpu.sh OUT [COMMIT] [TRUTH_S] [TEXT...]}
commit=${2:-$(git rev-parse --short HEAD)}
truth_s=${3:-300}
shift $(( $# < 3 ? $# : 3 ))
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
mkdir -p "$out" /tmp/gpu_traces
began=$SECONDS

step() {  # step LIMIT_S COMMAND...: run it under a limit, saying when it started and how it ended
    local limit=$1
    shift
    echo "== at $((SECONDS - began)) s: $* (limit ${limit} s)"
    timeout -k 5 "$limit" "$@"
    echo "== rc $? after $((SECONDS - began)) s"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))'
step 120 python3 -m pytest -q -n 0 -p no:cacheprovider -m "not slow" -k "cuda or gpu" \
    tests/test_gpu.py tests/test_runtime_offload.py tests/test_runtime.py >"$out/pytest.txt" 2>&1
tail -3 "$out/pytest.txt"
step 60 python3 bench/vocab_head.py --device cuda --dtypes bf16 --out "$out/vocab_head_cuda.json"
step 120 python3 bench/compile.py --device cuda --models gpt-125m --steps 12 --out "$out/compile_cuda.json"
step $((truth_s + 60)) python3 bench/gpu_truth.py --deadline "$truth_s" --commit "$commit" \
    --traces /tmp/gpu_traces --out "$out/gpu_truth.json" ${1:+--only "$@"}
tar czf "$out/traces.tgz" -C /tmp/gpu_traces .
step 90 python3 bench/executor_overhead.py --models gpt-125m --out "$out/executor_overhead_cuda.json"
echo "== done after $((SECONDS - began)) s"

#!/usr/bin/env bash
# The GPU half of the test suite and the GPU benchmarks (issue 8), in two steps:
#
#   scripts/gpu-suite.sh build   # on any x86-64 machine with Rust: test and bench
#                                # binaries with CUDA support into .device-bin/
#   scripts/gpu-suite.sh run     # on the GPU machine (no Rust needed), from the repo root
#                                # with .device-bin/ present; logs go to $OUT (or ./gpu-logs)
#   scripts/gpu-suite.sh tests   # `run`'s two halves on their own, for short device leases
#   scripts/gpu-suite.sh bench
#   eval "$(scripts/gpu-suite.sh env)"   # the same LD_LIBRARY_PATH, to run a binary by hand
#
# `run` points LD_LIBRARY_PATH at the CUDA, cuBLAS, NVRTC and NCCL libraries of the
# machine's Python packages (nvidia-*) and toolkit, with unversioned symlinks (cudarc
# looks for libnccl.so; pip ships libnccl.so.2), then runs every GPU test binary, comm-bench
# (NCCL with 1 rank, the local backend over device buffers with 2 and 4 ranks on one GPU,
# NCCL with 2 ranks on one GPU where NCCL allows it), and the tape and block benchmarks next
# to their PyTorch twins on the same GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=.device-bin

build() {
    set -e
    rm -rf "$BIN"
    mkdir -p "$BIN"
    local features="comm-core/cuda,comm-core/cli,tape/cuda"
    # The test binaries with device code (the carry limit is 64 MiB): the GPU tests, the
    # device-vs-CPU tests, and the library unit tests (NVRTC compiles every kernel).
    cargo test --release -p comm-core -p tape -p layers -p integration-tests \
        --features "$features" --no-run --message-format=json 2>/dev/null |
        python3 -c '
import json, sys
wanted = {"gpu_local", "gpu_nccl", "device", "device_math", "device_nn", "device_shape",
          "device_training", "main_grad", "lending", "flat_updates", "low_precision", "shape_memory",
          "pointwise_memory",
          "comm_core", "tape"}
for line in sys.stdin:
    m = json.loads(line)
    if (m.get("reason") == "compiler-artifact" and m.get("executable")
            and m["profile"]["test"] and m["target"]["name"].replace("-", "_") in wanted):
        print(m["executable"])
' | while read -r exe; do cp "$exe" "$BIN/test-$(basename "$exe")"; done
    cargo build --release -p comm-core --features comm-core/cuda,comm-core/cli --bin comm-bench
    cargo build --release -p tape --features tape/cuda --example bench_device
    cargo build --release -p layers --features tape/cuda --example bench_block
    cargo build --release -p train-gpt --features cuda
    cargo build --release -p ddp --features cuda --example bench_ddp
    cp target/release/comm-bench target/release/examples/bench_device \
        target/release/examples/bench_block target/release/examples/bench_ddp \
        target/release/train-gpt "$BIN/"
    # Debug info is most of the size.
    strip --strip-debug "$BIN"/*
    du -sh "$BIN"
}

# A directory of unversioned symlinks to the CUDA libraries found on this machine, and
# the directories holding them, for LD_LIBRARY_PATH.
library_path() {
    local links site dirs=""
    links=$(mktemp -d)
    site=$(python3 -c 'import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]))' \
        2>/dev/null || true)
    for lib in libnvrtc libcublas libcublasLt libnccl libcudart; do
        local found
        found=$(find ${site:+"$site/nvidia"} /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu \
            -name "$lib.so*" 2>/dev/null | sort | tail -1)
        if [ -n "$found" ]; then
            ln -sf "$found" "$links/$lib.so"
            dirs="$dirs:$(dirname "$found")"
        fi
    done
    echo "$links$dirs"
}

setup() {
    export LD_LIBRARY_PATH="$(library_path):${LD_LIBRARY_PATH:-}"
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
}

tests() {
    local logs=${OUT:-gpu-logs}
    mkdir -p "$logs"
    local failed=0
    for test in "$BIN"/test-*; do
        echo "== $test"
        # --nocapture: the `skipped: <reason>` lines must reach the log.
        "$test" --test-threads=4 --nocapture >"$logs/$(basename "$test").log" 2>&1 || {
            failed=1
            echo "FAILED: $test"
        }
        grep -E "test result|skipped|panicked" "$logs/$(basename "$test").log" | sort | uniq -c
    done
    return $failed
}

bench() {
    echo "== comm-bench"
    "$BIN/comm-bench" --backend nccl --ranks 1 --sizes 1K,1M,64M --json
    for ranks in 2 4; do
        "$BIN/comm-bench" --memory cuda --ranks "$ranks" --sizes 1K,1M,64M --baseline device-copy --json
    done
    NCCL_MULTI_RANK_GPU_ENABLE=1 "$BIN/comm-bench" --backend nccl --ranks 2 --sizes 1K,1M,64M --json ||
        echo "NCCL with 2 ranks on one GPU failed (it needs NCCL >= 2.30; see the error above)"
    echo "== GEMM and per-op overhead: tape, then PyTorch"
    "$BIN/bench_device" --device cuda:0
    python3 tape/benches/torch_device_reference.py 4096
    echo "== transformer block: ferrotron TP=1 and TP=2 on one GPU, then PyTorch"
    "$BIN/bench_block" --tp 1 --device cuda:0 --json
    "$BIN/bench_block" --tp 2 --device cuda:0 --json
    python3 layers/benches/bench_block.py --device cuda --json
    echo "== the demo on the GPU: TP 2 x DP 2 (and with PP 2) against the serial run, then timed"
    local logs=${OUT:-gpu-logs}
    "$BIN/train-gpt" --device cuda:0 --steps 20 --check --out "$logs/demo" | tail -1
    "$BIN/train-gpt" --device cuda:0 --pp 2 --layers 2 --steps 20 --check --sequence-parallel \
        --out "$logs/demo" | tail -1
    # The distributed optimizer's device step (reduce-scatter and all-gather into lent
    # memory) with bf16 products (GemmEx), on one rank's stream and over NCCL.
    "$BIN/train-gpt" --device cuda:0 --use-distributed-optimizer --precision bf16 --steps 20 \
        --check --out "$logs/demo" | tail -1
    NCCL_MULTI_RANK_GPU_ENABLE=1 "$BIN/train-gpt" --backend nccl --device cuda:0 --tp 2 --dp 2 \
        --use-distributed-optimizer --precision bf16 --steps 20 --check --out "$logs/demo" |
        tail -1 || echo "the sharded bf16 demo over NCCL failed (see the error above)"
    local start=$SECONDS
    "$BIN/train-gpt" --device cuda:0 --out "$logs/demo" | tail -3
    echo "default run: $((SECONDS - start)) s"
    echo "== DDP overlap on the GPU: local backend over device memory, then NCCL (2 ranks)"
    "$BIN/bench_ddp" --device cuda:0 --ranks 2 --json
    NCCL_MULTI_RANK_GPU_ENABLE=1 "$BIN/bench_ddp" --backend nccl --device cuda:0 --ranks 2 \
        --json || echo "bench_ddp over NCCL failed (see the error above)"
    echo "== the demo over NCCL on one GPU (TP 2 x DP 1, TP 2 x DP 2) against the CPU curve"
    local failed=0
    for dp in 1 2; do
        "$BIN/train-gpt" --tp 2 --dp $dp --steps 20 --out "$logs/cpu-dp$dp" | tail -1
        NCCL_MULTI_RANK_GPU_ENABLE=1 "$BIN/train-gpt" --backend nccl --device cuda:0 --tp 2 \
            --dp $dp --steps 20 --check --out "$logs/nccl-dp$dp" | tail -3
        python3 - "$logs/cpu-dp$dp/loss.csv" "$logs/nccl-dp$dp/loss.csv" <<'PY' || failed=1
import csv, sys
curves = [[float(row["loss"]) for row in csv.DictReader(open(path))] for path in sys.argv[1:]]
worst = max(abs(a - b) for a, b in zip(*curves))
print(f"NCCL vs CPU loss curve: max difference {worst:.2e}",
      "(within 1e-3)" if worst <= 1e-3 else "(OVER 1e-3)")
sys.exit(0 if worst <= 1e-3 else 1)
PY
    done
    return $failed
}

case "${1:-}" in
build) build ;;
run) setup; tests; status=$?; bench || status=1; exit $status ;;
tests) setup && tests ;;
bench) setup && bench ;;
env) echo "export LD_LIBRARY_PATH=$(library_path):${LD_LIBRARY_PATH:-}" ;;
*)
    echo "usage: $0 build|run|tests|bench|env" >&2
    exit 2
    ;;
esac

#!/usr/bin/env bash
# The GPU half of the test suite and the GPU benchmarks (issue 8), in two steps:
#
#   scripts/gpu-suite.sh build   # on any x86-64 machine with Rust: test and bench
#                                # binaries with CUDA support into .device-bin/, packed
#                                # into .device-pack/ (carry that)
#   scripts/gpu-suite.sh run     # on the GPU machine (no Rust needed), from the repo root
#                                # with .device-bin/ present; logs go to $LOGS, $OUT
#                                # or ./gpu-logs
#   scripts/gpu-suite.sh tests   # `run`'s parts on their own, for short device leases
#   scripts/gpu-suite.sh nccl    # (every run with two or more NCCL ranks)
#   scripts/gpu-suite.sh bench
#   scripts/gpu-suite.sh gpt     # the GPT step at GPT-2 small's shape beside its PyTorch
#                                # twin, the row kernels' bandwidth and attention's time
#                                # beside PyTorch's (JSON lines; in `run` too)
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
    local features="ferrotron-comm-core/cuda,ferrotron-comm-core/cli,ferrotron-tape/cuda"
    # The test binaries with device code (the carry limit is 64 MiB): the GPU tests, the
    # device-vs-CPU tests, and the library unit tests (NVRTC compiles every kernel).
    cargo test --release -p ferrotron-device -p ferrotron-comm-core -p ferrotron-tape -p ferrotron-layers -p integration-tests \
        --features "$features,ferrotron-device/cuda" --no-run --message-format=json 2>/dev/null |
        python3 -c '
import json, sys
wanted = {"gpu", "gpu_local", "gpu_nccl", "device", "device_math", "device_nn", "device_shape",
          "device_training", "main_grad", "lending", "flat_updates", "low_precision", "shape_memory",
          "pointwise_memory", "device_rows", "device_profile", "device_attention", "device_fusions",
          "fused_attention", "tensor_core_attention",
          "multi_tensor_step", "adamw_numerics", "master_weights",
          "ferrotron_device", "ferrotron_comm_core", "ferrotron_tape"}
for line in sys.stdin:
    m = json.loads(line)
    if (m.get("reason") == "compiler-artifact" and m.get("executable")
            and m["profile"]["test"] and m["target"]["name"].replace("-", "_") in wanted):
        print(m["executable"])
' | while read -r exe; do cp "$exe" "$BIN/test-$(basename "$exe")"; done
    cargo build --release -p ferrotron-comm-core --features cuda,cli --bin comm-bench
    cargo build --release -p ferrotron-tape --features cuda --example bench_device
    cargo build --release -p ferrotron-tape --features cuda --example bench_rows
    cargo build --release -p ferrotron-tape --features cuda --example bench_attention
    cargo build --release -p ferrotron-layers --features ferrotron-tape/cuda --example bench_block
    cargo build --release -p ferrotron-train-gpt --features cuda
    cargo build --release -p ferrotron-ddp --features cuda --example bench_ddp
    cp target/release/comm-bench target/release/examples/bench_device \
        target/release/examples/bench_rows target/release/examples/bench_attention \
        target/release/examples/bench_block target/release/examples/bench_ddp \
        target/release/train-gpt "$BIN/"
    # Debug info is most of the size.
    strip --strip-debug "$BIN"/*
    du -sh "$BIN"
    # The binaries come to about 64 MiB, the device tool's carry limit: carry them packed.
    mkdir -p .device-pack
    tar cf - "$BIN" | xz -T0 -6 >.device-pack/bin.tar.xz
    du -sh .device-pack
}

# Unpacks the carried binaries, replacing any left from an earlier call (a warm device
# machine keeps ignored files between calls).
unpack() {
    if [ -f .device-pack/bin.tar.xz ]; then
        rm -rf "$BIN"
        tar xJf .device-pack/bin.tar.xz
    fi
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
        # NCCL_LIB=/path/libnccl.so.2 picks another NCCL (two ranks on one GPU need 2.30).
        if [ "$lib" = libnccl ] && [ -n "${NCCL_LIB:-}" ]; then
            found=$(realpath -e "$NCCL_LIB") || {
                echo "NCCL_LIB=$NCCL_LIB does not exist" >&2
                found=""
            }
        fi
        if [ -n "$found" ]; then
            ln -sf "$found" "$links/$lib.so"
            dirs="$dirs:$(dirname "$found")"
        fi
    done
    echo "$links$dirs"
}

setup() {
    unpack
    export LD_LIBRARY_PATH="$(library_path):${LD_LIBRARY_PATH:-}"
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    versions
}

# Logs go to $LOGS, else $OUT, else ./gpu-logs. Every command has a time limit, so one
# that hangs costs its limit and not the lease.
logs_dir() { echo "${LOGS:-${OUT:-gpu-logs}}"; }

# `limit SECONDS COMMAND...`: runs it, and says so when it ran out of time.
limit() {
    local seconds=$1
    shift
    timeout --kill-after=5 "$seconds" "$@"
    local status=$?
    [ $status -eq 124 ] || [ $status -eq 137 ] && echo "TIMED OUT after ${seconds} s: $*"
    return $status
}

versions() {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
    python3 -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda,
        "NCCL", ".".join(map(str, torch.cuda.nccl.version())))' || true
    pip list 2>/dev/null | grep -i -E "^nvidia-(nccl|cublas|cuda-nvrtc|cuda-runtime)" || true
}

tests() {
    local logs
    logs=$(logs_dir)
    mkdir -p "$logs"
    local failed=0
    for test in "$BIN"/test-*; do
        echo "== $test"
        # --nocapture: the `skipped: <reason>` lines must reach the log.
        NCCL_MULTI_RANK_GPU_ENABLE=1 limit 120 "$test" --test-threads=4 --nocapture \
            >"$logs/$(basename "$test").log" 2>&1 || {
            failed=1
            echo "FAILED: $test"
            grep -E "^test .*FAILED|panicked" "$logs/$(basename "$test").log" | head -5
        }
        grep -E "test result|skipped|TIMED OUT" "$logs/$(basename "$test").log" | sort | uniq -c
    done
    return $failed
}

# `compare CPU.csv DEVICE.csv`: the largest loss difference between two curves (≤ 1e-3).
compare() {
    python3 - "$@" <<'PY'
import csv, sys
curves = [[float(row["loss"]) for row in csv.DictReader(open(path))] for path in sys.argv[1:]]
worst = max(abs(a - b) for a, b in zip(*curves))
print(f"device vs CPU loss curve: max difference {worst:.2e}",
      "(within 1e-3)" if worst <= 1e-3 else "(OVER 1e-3)")
sys.exit(0 if worst <= 1e-3 else 1)
PY
}

# The demo over NCCL with two or four ranks on the one GPU, against the same run on the CPU.
nccl_demo() {
    local logs failed=0 name
    logs=$(logs_dir)
    # TP 2 x DP 2 last: it has hung with every rank on one GPU (see the book).
    local layouts=("--tp 2 --dp 1" "--pp 2 --layers 2"
        "--pp 2 --layers 2 --microbatches 4 --use-distributed-optimizer --precision bf16 --clip-grad 1.0"
        "--tp 2 --dp 2" "--tp 2 --dp 2 --use-distributed-optimizer --precision bf16")
    for layout in "${layouts[@]}"; do
        name=$(echo "$layout" | tr -d ' -')
        echo "-- NCCL $layout"
        # shellcheck disable=SC2086
        limit 60 "$BIN/train-gpt" $layout --steps 20 --out "$logs/cpu-$name" | tail -1
        # shellcheck disable=SC2086
        NCCL_MULTI_RANK_GPU_ENABLE=1 limit 60 "$BIN/train-gpt" --backend nccl --device cuda:0 \
            $layout --steps 20 --check --out "$logs/nccl-$name" |
            grep -E "^device transfers|^host waits|difference|TIMED OUT" || failed=1
        compare "$logs/cpu-$name/loss.csv" "$logs/nccl-$name/loss.csv" || failed=1
    done
    return $failed
}

# Everything with two or more NCCL ranks: the tests, the collectives, DDP, the demo.
nccl_all() {
    local logs failed=0 test
    logs=$(logs_dir)
    mkdir -p "$logs"
    export NCCL_MULTI_RANK_GPU_ENABLE=1
    for test in "$BIN"/test-gpu_nccl-*; do
        limit 120 "$test" --test-threads=1 --nocapture >"$logs/$(basename "$test").log" 2>&1 ||
            failed=1
        grep -E "^test |test result|skipped" "$logs/$(basename "$test").log"
    done
    limit 60 "$BIN/comm-bench" --backend nccl --ranks 2 --sizes 1K,1M,64M --json || failed=1
    limit 60 "$BIN/bench_ddp" --backend nccl --device cuda:0 --ranks 2 --json || failed=1
    nccl_demo || failed=1
    return $failed
}

bench() {
    local logs failed=0
    logs=$(logs_dir)
    echo "== GEMM (f32, TF32, bf16 8192²) and per-op overhead: tape, then PyTorch"
    limit 60 "$BIN/bench_device" --device cuda:0 || failed=1
    limit 60 python3 tape/benches/torch_device_reference.py 4096 8192
    echo "== transformer block, TP 1 in f32 and bf16, then PyTorch; TP 2 on one GPU"
    limit 60 "$BIN/bench_block" --tp 1 --device cuda:0 --json --steps 20 || failed=1
    limit 60 "$BIN/bench_block" --tp 1 --device cuda:0 --json --steps 20 --bf16 || failed=1
    limit 60 python3 layers/benches/bench_block.py --device cuda --json --steps 20
    limit 60 python3 layers/benches/bench_block.py --device cuda --json --steps 20 --bf16
    limit 60 "$BIN/bench_block" --tp 2 --device cuda:0 --json || failed=1
    echo "== DDP overlap on the GPU: local backend over device memory, then NCCL (2 ranks)"
    limit 60 "$BIN/bench_ddp" --device cuda:0 --ranks 2 --json || failed=1
    NCCL_MULTI_RANK_GPU_ENABLE=1 limit 60 "$BIN/bench_ddp" --backend nccl --device cuda:0 \
        --ranks 2 --json || failed=1
    echo "== collectives: NCCL 1 and 2 ranks, the local backend over device memory"
    limit 60 "$BIN/comm-bench" --backend nccl --ranks 1 --sizes 1K,1M,64M --json
    NCCL_MULTI_RANK_GPU_ENABLE=1 limit 60 "$BIN/comm-bench" --backend nccl --ranks 2 \
        --sizes 1K,1M,64M --json || failed=1
    limit 60 "$BIN/comm-bench" --memory cuda --ranks 2 --sizes 1K,1M,64M \
        --baseline device-copy --json
    echo "== the demo on the GPU over threads: TP 2 x DP 2 (and PP 2, SP; ZeRO bf16) vs one rank"
    local counts="^device transfers|^host waits|max loss difference|TIMED OUT"
    limit 60 "$BIN/train-gpt" --device cuda:0 --steps 20 --check --out "$logs/demo" |
        grep -E "$counts" || failed=1
    limit 60 "$BIN/train-gpt" --device cuda:0 --pp 2 --layers 2 --steps 20 --check \
        --sequence-parallel --out "$logs/demo" | grep -E "$counts" || failed=1
    limit 60 "$BIN/train-gpt" --device cuda:0 --pp 2 --layers 4 --steps 20 --check \
        --schedule interleaved --virtual-stages 2 --microbatches 2 --overlap-p2p-comm \
        --out "$logs/demo" |
        grep -E "$counts" || failed=1
    limit 60 "$BIN/train-gpt" --device cuda:0 --use-distributed-optimizer --precision bf16 \
        --steps 20 --check --out "$logs/demo" | grep -E "$counts" || failed=1
    limit 60 "$BIN/train-gpt" --device cuda:0 --use-distributed-optimizer --precision bf16 \
        --overlap-param-gather --ddp-bucket-size 4000 --steps 20 --check --out "$logs/demo" |
        grep -E "$counts" || failed=1
    echo "== the default demo run on cuda:0, timed"
    local start=$SECONDS
    limit 120 "$BIN/train-gpt" --device cuda:0 --out "$logs/demo" | tail -3 || failed=1
    echo "default run: $((SECONDS - start)) s"
    return $failed
}

# The demo's step at GPT-2 small's shape (bf16 and f32) beside train-gpt/benches/gpt_step.py
# on the same GPU, as JSON lines (train-gpt's: the median of its per-step times after the
# first two steps), then the row kernels' bandwidth beside PyTorch's.
gpt() {
    local logs failed=0 precision
    logs=$(logs_dir)
    mkdir -p "$logs"
    local shape="--hidden 768 --layers 12 --heads 12 --seq 1024 --batch 8"
    # The PyTorch twin's step does not clip; the demo clips by default.
    local unclipped="--clip-grad 0"
    for precision in bf16 fp32; do
        # shellcheck disable=SC2086
        limit 180 "$BIN/train-gpt" --tp 1 --dp 1 $shape $unclipped --precision $precision \
            --device cuda:0 --steps 8 --eval-interval 0 --out "$logs/gpt-$precision" \
            >"$logs/gpt-$precision.log" 2>&1 || failed=1
        python3 - "$logs/gpt-$precision.log" "$precision" <<'PY'
import json, re, statistics, sys
times = [float(m.group(1)) for m in re.finditer(r"elapsed time per step \(ms\) ([0-9.]+)", open(sys.argv[1]).read())]
ms = statistics.median(times[2:]) if len(times) > 2 else None
print(json.dumps({"bench": "gpt_step", "impl": "ferrotron", "attention": "auto",
                  "precision": sys.argv[2], "ms_per_step": ms,
                  "tokens_per_s": 8 * 1024 / (ms * 1e-3) if ms else None}))
PY
        for attention in explicit sdpa; do
            # shellcheck disable=SC2086
            limit 120 python3 train-gpt/benches/gpt_step.py $shape --precision $precision \
                --attention $attention || failed=1
        done
    done
    # The kernels of one bf16 step, for where the time goes.
    # shellcheck disable=SC2086
    limit 180 "$BIN/train-gpt" --tp 1 --dp 1 $shape $unclipped --precision bf16 --device cuda:0 \
        --steps 3 --eval-interval 0 --profile --out "$logs/gpt-profile" |
        sed -n '/^kernels per step/,/^kernel time/p' || failed=1
    limit 120 "$BIN/bench_rows" --device cuda:0 || failed=1
    limit 120 python3 tape/benches/torch_rows_reference.py || failed=1
    # Attention's forward and backward (fused on tensor cores and on CUDA cores, unfused)
    # beside PyTorch's SDPA: GPT-2 small's heads, then Llama's (grouped, 128 wide).
    local llama="--batch 2 --heads 32 --groups 8 --head-dim 128 --seqs 4096 --dtypes bf16"
    limit 120 "$BIN/bench_attention" --device cuda:0 || failed=1
    limit 120 python3 tape/benches/torch_attention_reference.py || failed=1
    # shellcheck disable=SC2086
    limit 120 "$BIN/bench_attention" --device cuda:0 $llama || failed=1
    # shellcheck disable=SC2086
    limit 120 python3 tape/benches/torch_attention_reference.py $llama || failed=1
    return $failed
}

case "${1:-}" in
build) build ;;
run)
    setup
    tests
    status=$?
    echo "== the demo over NCCL on one GPU against the CPU curve"
    nccl_demo || status=1
    bench || status=1
    gpt || status=1
    exit $status
    ;;
tests) setup && tests ;;
nccl) setup && nccl_all ;;
bench) setup && bench ;;
gpt) setup && gpt ;;
env) echo "export LD_LIBRARY_PATH=$(library_path):${LD_LIBRARY_PATH:-}" ;;
*)
    echo "usage: $0 build|run|tests|nccl|bench|gpt|env" >&2
    exit 2
    ;;
esac

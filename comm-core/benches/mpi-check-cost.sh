#!/usr/bin/env bash
# The MPI signature check's cost: comm-bench's all-reduce under mpirun with the check on
# (the default) and off (FERROTRON_MPI_CHECK=0), alternating runs so the machine's noise
# shows in both columns. Prints the median time per size, ranks and setting.
# Usage: comm-core/benches/mpi-check-cost.sh [REPEATS] [RANKS...]   (default 5, 2 4)
set -euo pipefail
cd "$(dirname "$0")/../.."
repeats=${1:-5}
shift || true
ranks_list=("${@:-2 4}")
read -r -a ranks_list <<<"${ranks_list[*]}"
cargo build --release -q -p ferrotron-comm-core --features mpi,cli --bin comm-bench
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl="self,vader" OMPI_MCA_btl_vader_single_copy_mechanism=none
results=$(mktemp)
for ranks in "${ranks_list[@]}"; do
    for ((rep = 1; rep <= repeats; rep++)); do
        for check in 1 0; do
            mpirun --oversubscribe -n "$ranks" -x FERROTRON_MPI_CHECK="$check" \
                target/release/comm-bench --backend mpi --sizes 1K,64K,1M,16M,64M --json |
                sed "s/^{/{\"check\":$check,\"ranks\":$ranks,/" >>"$results"
        done
    done
done
python3 - "$results" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
table = {}
for r in rows:
    table.setdefault((r["ranks"], r["bytes"]), {}).setdefault(r["check"], []).append(r["time_us"])
print("| ranks | bytes | check on µs, median (min) | check off µs, median (min) | added µs (median) | ratio |")
print("|---:|---:|---:|---:|---:|---:|")
for (ranks, size), by in sorted(table.items()):
    on, off = statistics.median(by[1]), statistics.median(by[0])
    label = f"{size // 2**20} MiB" if size >= 2**20 else f"{size // 1024} KiB"
    print(f"| {ranks} | {label} | {on:.2f} ({min(by[1]):.2f}) | {off:.2f} ({min(by[0]):.2f}) "
          f"| {on - off:+.2f} | {on / off:.2f} |")
PY
echo "raw results: $results"

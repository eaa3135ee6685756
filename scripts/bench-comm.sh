#!/usr/bin/env bash
# Side-by-side collective benchmark for the performance chapter: the local backend (with
# its memcpy baseline) and the MPI backend (with raw rsmpi) on the same machine, in one
# run, followed by the ratios the targets are stated in.
# Usage: scripts/bench-comm.sh [ranks] [sizes]     (defaults: 2 and 1K,64K,1M,16M,64M)
set -euo pipefail
cd "$(dirname "$0")/.."
ranks="${1:-2}"
sizes="${2:-1K,64K,1M,16M,64M}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

cargo build -q --release -p ferrotron-comm-core --features mpi,cli --bin comm-bench
bench=target/release/comm-bench
out=$(mktemp)
echo "# $(date -u +%Y-%m-%dT%H:%MZ) $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
"$bench" --backend local --ranks "$ranks" --op all_reduce --sizes "$sizes" --baseline memcpy --json | tee -a "$out"
mpirun --oversubscribe -n "$ranks" "$bench" --backend mpi --op all_reduce --sizes "$sizes" --baseline raw --json | tee -a "$out"

# One line per size: local algbw as a multiple of raw MPI's and a fraction of memcpy's,
# and the MPI backend's time relative to raw rsmpi.
awk -F'[:,]' '
    { for (i = 1; i < NF; i++) { gsub(/[{}" ]/, "", $i); gsub(/[{}" ]/, "", $(i+1)); v[$i] = $(i+1) }
      t[v["backend"], v["bytes"]] = v["time_us"]
      if (!(v["bytes"] in seen)) { seen[v["bytes"]] = 1; order[++n] = v["bytes"] } }
    END {
      printf "%12s %16s %16s %18s %16s\n", "bytes", "local/raw-mpi", "local/memcpy", "mpi-raw time_us", "mpi/raw time"
      for (k = 1; k <= n; k++) { b = order[k]
        printf "%12d %15.2fx %15.0f%% %18.2f %15.3fx\n", b, t["raw-mpi", b] / t["local", b],
               100 * t["memcpy", b] / t["local", b], t["mpi", b] - t["raw-mpi", b], t["mpi", b] / t["raw-mpi", b] }
    }' "$out"
rm -f "$out"

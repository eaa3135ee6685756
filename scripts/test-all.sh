#!/usr/bin/env bash
# The whole ferrotron test suite, as CI runs it (.ci/run calls exactly this script).
# Installs what it needs on Debian/Ubuntu (skipping what is present), then runs:
# rustfmt, clippy with every feature, all workspace tests (unit, integration, doc; the
# doctests include every Rust example of the mdBook), the emulated device's tests again
# under FERROTRON_EMULATED_JITTER with two seeds, the MPI test binaries under mpirun
# with 2 and 4 ranks, the check that mismatched MPI calls fail every rank with no setting,
# a rank killed and resumed under mpirun, the API docs as docs.rs builds them, every
# publishable package built from its .crate and used by a crate outside the workspace,
# and the mdBook.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
for pkg in libopenmpi-dev openmpi-bin libclang-dev; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
    echo "==> installing ${missing[*]}"
    sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
fi
for component in rustfmt clippy; do
    cargo "${component/rustfmt/fmt}" --version >/dev/null 2>&1 || rustup component add "$component"
done
mdbook_version=0.5.4
if ! mdbook --version 2>/dev/null | grep -q "$mdbook_version"; then
    echo "==> installing mdbook $mdbook_version"
    cargo install --locked --quiet mdbook --version "$mdbook_version"
fi

# CI builds everything once: an incremental cache would only take disk (gigabytes for
# the suite's test binaries) and save nothing.
export CARGO_INCREMENTAL=0
# OpenMPI refuses to start as root unless told; CI machines run as root.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Containers often lack the network interfaces OpenMPI probes; stay on shared memory.
export OMPI_MCA_btl="self,vader" OMPI_MCA_btl_vader_single_copy_mechanism=none

echo "==> cargo fmt --check"
cargo fmt --all --check
echo "==> cargo clippy"
cargo clippy --workspace --all-targets --all-features -- -D warnings
echo "==> cargo test"
# A hung test must fail the run with its name on screen (the harness prints "has been
# running for over 60 seconds"), not use up CI's whole budget; the suite takes minutes.
status=0
timeout -k 30 40m cargo test --workspace --all-features || status=$?
if [ "$status" -ne 0 ]; then
    [ "$status" -eq 124 ] && echo "cargo test did not finish in 40 minutes: a test hung" >&2
    exit "$status"
fi

# Each test binary with the source file it was built from: "SOURCE EXECUTABLE".
test_binaries=$(cargo test --workspace --all-features --no-run --message-format=json 2>/dev/null |
    sed -n 's/.*"src_path":"\([^"]*\)".*"executable":"\([^"]*\)".*/\1 \2/p' | sort -u)

echo "==> the emulated device's tests again, its streams' workers delayed at random"
# Every test file that runs on the emulated device (directly or through tape's device
# helper), run from its package's directory as cargo runs it; a file with no binary fails.
emulated=$(grep -rlE 'Emulated|emulated|support/device\.rs' --include='*.rs' "$PWD"/*/tests |
    grep -v '/support/' | sort -u)
for seed in 1 2; do
    for file in $emulated; do
        test=$(echo "$test_binaries" | awk -v f="$file" '$1 == f { print $2 }')
        if [ -z "$test" ]; then
            echo "no test binary was built from $file" >&2
            exit 1
        fi
        log=$(mktemp)
        (cd "${file%%/tests/*}" && FERROTRON_EMULATED_JITTER=$seed timeout 600 "$test" -q) \
            >"$log" 2>&1 || {
            cat "$log" >&2
            echo "$file failed with FERROTRON_EMULATED_JITTER=$seed" >&2
            exit 1
        }
        rm "$log"
    done
    echo "--> FERROTRON_EMULATED_JITTER=$seed: the tests of $(echo "$emulated" | wc -w) files passed"
done

echo "==> MPI test binaries under mpirun"
mpi_tests=$(echo "$test_binaries" | awk '{ print $2 }' | grep -E '/mpi_[a-z_]*-[0-9a-f]*$')
if [ -z "$mpi_tests" ]; then
    echo "no MPI test binaries found" >&2
    exit 1
fi
passed=0
for ranks in 2 4; do
    for test in $mpi_tests; do
        echo "--> mpirun -n $ranks $(basename "$test")"
        timeout 600 mpirun --oversubscribe -n "$ranks" "$test"
        passed=$((passed + 1))
    done
done
echo "mpi: $passed passed, 0 failed"

# Where cargo put a binary it built (CARGO_TARGET_DIR or a config may move target/).
built() {
    cargo build -q --message-format=json "$@" |
        sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n 1
}

echo "==> mismatched MPI calls fail every rank, with no environment variable set"
mismatch=$(built -p ferrotron-comm-core --all-features --example mismatch)
for ranks in 2 4; do
    # Each rank writes its own file: mpirun interleaves the ranks' stderr, and alone it
    # ends the job at the first failing rank and reports only that one.
    reports=$(mktemp -d)
    env -u FERROTRON_MPI_CHECK REPORTS="$reports" timeout 60 mpirun --oversubscribe -x REPORTS \
        -n "$ranks" sh -c '"$0" >"$REPORTS/$OMPI_COMM_WORLD_RANK" 2>&1
            echo "exit status $?" >>"$REPORTS/$OMPI_COMM_WORLD_RANK"' \
        "$mismatch" >/dev/null 2>&1 || true
    failed=$(cat "$reports"/* | grep -c '^exit status 1$' || true)
    reported=$(cat "$reports"/* | grep -c ': Mismatch: ' || true)
    if [ "$failed" -ne "$ranks" ] || [ "$reported" -ne "$ranks" ]; then
        tail -n +1 "$reports"/* >&2
        echo "expected all $ranks ranks to report Mismatch and exit 1: $reported reported it," \
            "$failed exited 1" >&2
        exit 1
    fi
    rm -r "$reports"
    echo "--> mpirun -n $ranks mismatch: all $ranks ranks reported Mismatch and exited 1"
done

echo "==> a rank killed mid-run under mpirun -n 4: the job fails, --resume auto continues exactly"
train_gpt=$(built -p ferrotron-train-gpt --features mpi --bin train-gpt)
run_dir=$(mktemp -d)
trap 'rm -rf "$run_dir"' EXIT
small="--backend mpi --tp 2 --layers 1 --hidden 16 --heads 2 --seq 16 --eval-interval 0 --steps 12"
at=$((3 + RANDOM % 8))
timeout 120 mpirun --oversubscribe -n 4 "$train_gpt" $small --out "$run_dir/A" >/dev/null
killed=0
# mpirun interleaves the ranks' output, so the check reads the kill's message from its
# second word on.
FERROTRON_KILL_AT="2@$at" timeout 120 mpirun --oversubscribe -x FERROTRON_KILL_AT -n 4 \
    "$train_gpt" $small --save "$run_dir/C" --save-interval 2 --out "$run_dir/B" \
    >"$run_dir/killed.log" 2>&1 || killed=$?
if [ "$killed" -eq 0 ] || [ "$killed" -eq 124 ] ||
    ! grep -q "kills itself after step $at (FERROTRON_KILL_AT)" "$run_dir/killed.log"; then
    cat "$run_dir/killed.log" >&2
    echo "the run whose rank 2 was to die after step $at ended with status $killed" >&2
    exit 1
fi
saved=$(ls "$run_dir/C" | grep '^step_' | tail -1)
timeout 120 mpirun --oversubscribe -n 4 "$train_gpt" $small --save "$run_dir/C" \
    --resume auto --out "$run_dir/B" >"$run_dir/resumed.log"
grep -q "resuming the run saved in .*$saved" "$run_dir/resumed.log"
diff "$run_dir/A/loss.csv" "$run_dir/B/loss.csv"
echo "--> rank 2 killed after step $at: the job failed; resumed from $saved with the" \
    "uninterrupted run's losses"
rm -r "$run_dir"
trap - EXIT

echo "==> cargo doc, as docs.rs builds it: a broken intra-doc link fails"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --all-features

echo "==> cargo package: every library packages, and builds from its package alone"
# Verification builds each package from its .crate with the registry's versions of the
# others (the freshly packaged ones). Cargo takes a registry crate of a known name and
# version for unchanged, its unpacked source and its build alike, so a run starts from
# an empty build directory and drops the sources an earlier run unpacked into cargo's
# cache; debug info would only cost disk here.
cargo_home=${CARGO_HOME:-$HOME/.cargo}
rm -rf target/package target/package-check \
    "$cargo_home"/registry/src/*/ferrotron-* "$cargo_home"/registry/cache/*/ferrotron-*
export CARGO_PROFILE_DEV_DEBUG=false
cargo package --workspace --exclude integration-tests --allow-dirty --locked \
    --target-dir target/package-check
echo "==> a crate outside the workspace builds the book's first example from the packages"
cargo test --doc --locked --manifest-path integration-tests/packaged/Cargo.toml \
    --target-dir target/package-check
unset CARGO_PROFILE_DEV_DEBUG

echo "==> mdbook build docs"
mdbook build docs

#!/usr/bin/env bash
# Checks that every crate, test, example and benchmark builds with the minimum supported
# Rust version the manifests state (`rust-version` in the root Cargo.toml), with every
# feature (the MPI feature needs the packages scripts/test-all.sh installs) and the
# locked dependencies. Installs that toolchain with rustup if missing.
set -euo pipefail
cd "$(dirname "$0")/.."
msrv=$(sed -n 's/^rust-version = "\(.*\)"$/\1/p' Cargo.toml)
[ -n "$msrv" ] || { echo "no rust-version in Cargo.toml" >&2; exit 1; }
rustup toolchain list | grep -q "^$msrv" || rustup toolchain install "$msrv" --profile minimal
echo "==> cargo +$msrv check --workspace --all-targets --all-features --locked"
CARGO_TARGET_DIR=target/msrv cargo +"$msrv" check --workspace --all-targets --all-features --locked

#!/usr/bin/env bash
# Mutation testing of the code that memory safety and exactness rest on: cargo-mutants
# changes one operator or function body at a time and reruns the package's tests; a
# mutant the tests do not notice ("missed") is behaviour no test pins. Not part of CI
# (about an hour on 2 cores); run it before changing one of the files below, and after,
# and kill every new survivor with a test (or, if it truly cannot change behaviour,
# exclude it in .cargo/mutants.toml with a one-line reason).
#
#   scripts/mutants.sh                 # every listed file
#   scripts/mutants.sh comm-core       # one package's files
#
# Prints caught / missed / unviable / timeouts per file and every survivor; exits 1 if any
# mutant was missed. Results stay in target/mutants/<package>/mutants.out.
set -euo pipefail
cd "$(dirname "$0")/.."

version=27.1.0
if ! cargo mutants --version 2>/dev/null | grep -q "$version"; then
    echo "==> installing cargo-mutants $version"
    cargo install --locked --quiet cargo-mutants --version "$version"
fi

# package: files (the local backend's group and collectives, the reduction kernel, the
# call checks, the flat storage gradients live in, 16-bit formats and master weights,
# the differentiable collectives, the loss, the gradient clipping and loss scaling, DDP's
# buckets, reducer and distributed optimizer, and the pipeline's schedules and driver).
declare -A files=(
    [comm-core]="comm-core/src/calls.rs comm-core/src/local/group.rs comm-core/src/local/mod.rs comm-core/src/dtype.rs"
    [tape]="tape/src/flat.rs tape/src/precision.rs tape/src/mixed.rs"
    [mappings]="mappings/src/*.rs"
    [layers]="layers/src/cross_entropy.rs layers/src/clip.rs layers/src/scaler.rs"
    [ddp]="ddp/src/bucket.rs ddp/src/reducer.rs ddp/src/named.rs ddp/src/optimizer.rs"
    [pipeline]="pipeline/src/schedule.rs pipeline/src/driver.rs"
)
packages=("${@:-comm-core tape mappings layers ddp pipeline}")
# shellcheck disable=SC2206
packages=(${packages[*]})

status=0
for package in "${packages[@]}"; do
    args=()
    for file in ${files[$package]}; do
        args+=(-f "$file")
    done
    out="target/mutants/$package"
    mkdir -p "$out"
    echo "==> cargo mutants -p $package ${args[*]}"
    cargo mutants -p "$package" "${args[@]}" --timeout 120 -o "$out" || status=1
done

python3 - "${packages[@]}" <<'PY'
import collections, json, sys
counts = collections.defaultdict(collections.Counter)
survivors = []
for package in sys.argv[1:]:
    path = f"target/mutants/{package}/mutants.out/outcomes.json"
    for outcome in json.load(open(path))["outcomes"]:
        mutant = outcome["scenario"]
        if not isinstance(mutant, dict) or "Mutant" not in mutant:
            continue  # the unmutated baseline
        mutant = mutant["Mutant"]
        summary = outcome["summary"]
        kind = {"CaughtMutant": "caught", "MissedMutant": "missed", "Unviable": "unviable",
                "Timeout": "timeout"}.get(summary, summary.lower())
        counts[mutant["file"]][kind] += 1
        if kind == "missed":
            survivors.append(mutant["name"])
print(f"{'file':<34} {'caught':>7} {'missed':>7} {'unviable':>9} {'timeout':>8}")
for file in sorted(counts):
    c = counts[file]
    print(f"{file:<34} {c['caught']:>7} {c['missed']:>7} {c['unviable']:>9} {c['timeout']:>8}")
print(f"survivors: {len(survivors)}")
for name in survivors:
    print(f"  {name}")
PY
exit "$status"

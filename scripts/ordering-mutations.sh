#!/usr/bin/env bash
# Removes, one at a time, each wait and record that orders device work between streams
# (a rank's compute and communication streams, two ranks' streams), reruns the emulated
# tests that cover it, and reports whether the emulated device's ordering checker named
# the missing order (`Error::Unordered`). A removal that the tests do not report as an
# ordering error is an order nothing checks. Not part of CI (each mutation rebuilds
# the tests); run it by hand after changing how device work is ordered between streams.
# A removed line that is a function's tail expression becomes `Ok(())`.
#
#   scripts/ordering-mutations.sh          # every mutation below
#   scripts/ordering-mutations.sh 2 3      # the second and third
#
# Prints one line per mutation (caught / not caught) and exits 1 if any was not caught.
# The mutated file is restored from a copy afterwards, also on interruption.
set -euo pipefail
cd "$(dirname "$0")/.."

# name | file | the exact line removed (leading spaces trimmed) | the tests that must name it
comm=(-p ferrotron-comm-core --all-features --test comm_streams --test device_messages --test emulated_memory)
device=(-p ferrotron-device --test memory)
mutations=(
    "receiver's stream waits for a device message's send event|comm-core/src/buffer.rs|on.wait(&message.sent)?;|comm"
    "a received device message is freed after the receiver's copy|comm-core/src/buffer.rs|unsafe { message.memory.free_on(on)? };|comm"
    "a receive's copy waits for its memory's stream (up to the post, when posted ahead)|comm-core/src/buffer.rs|on.wait(ready)?;|comm"
    "the receiving stream waits for the receive's copy before reading what landed|comm-core/src/buffer.rs|to.wait(&on.record()?)?;|comm"
    "communication stream waits for the buffers' streams (the NCCL backend's too)|comm-core/src/ordering.rs|comm.wait_for(&holder.mark()?)?;|comm"
    "buffers' streams wait for the collective (blocking at once, non-blocking at Work::wait; NCCL's handed-out work too)|comm-core/src/ordering.rs|holder.wait_for(done)?;|comm"
    "communication stream waits for the peers' buffers to be ready before moving them|comm-core/src/local/streamed.rs|comm.wait(ready)?;|comm"
    "communication stream waits for the peers' moves before its buffers are reused|comm-core/src/local/streamed.rs|comm.wait(&done)?;|comm"
    "a staging buffer is reused only after its upload has run|device/src/pinned.rs|src.track(self)|device"
    "pinned memory is read on the host only after its download has run|device/src/pinned.rs|dst.track(self)|device"
)

selected=("$@")
if [ ${#selected[@]} -eq 0 ]; then
    selected=($(seq 1 ${#mutations[@]}))
fi

backup=""
restore() {
    if [ -n "$backup" ]; then
        cp "$backup" "$file" && rm -f "$backup"
        backup=""
    fi
}
trap restore EXIT

status=0
for index in "${selected[@]}"; do
    IFS='|' read -r name file line suite <<<"${mutations[$((index - 1))]}"
    unset -n tests 2>/dev/null || true
    declare -n tests="$suite"
    backup="$(mktemp)"
    cp "$file" "$backup"
    python3 - "$file" "$line" <<'PY'
import sys
path, line = sys.argv[1], sys.argv[2]
text = open(path).read().split("\n")
hits = [i for i, l in enumerate(text) if l.strip() == line]
if len(hits) != 1:
    sys.exit(f"{path}: expected the line '{line}' once, found it {len(hits)} times")
line = text[hits[0]]
if line.rstrip().endswith(";"):
    del text[hits[0]]
else:
    text[hits[0]] = line[: len(line) - len(line.lstrip())] + "Ok(())"
open(path, "w").write("\n".join(text))
PY
    log="target/ordering-mutation-$index.log"
    if cargo test "${tests[@]}" >"$log" 2>&1; then
        verdict="not caught (the tests pass)"
        status=1
    elif grep -qE "unordered accesses|Unordered ?[({]" "$log"; then
        verdict="caught: an ordering error"
    else
        verdict="not caught as an ordering error (the tests fail otherwise; see $log)"
        status=1
    fi
    printf '%d. %s (%s): %s\n' "$index" "$name" "$file" "$verdict"
    restore
done
exit "$status"

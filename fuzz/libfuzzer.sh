#!/bin/bash
# Coverage-guided fuzzing of one accel target with libFuzzer, on the stable toolchain:
# SanitizerCoverage is an LLVM pass stable rustc runs with -Cpasses (no nightly, no
# cargo-fuzz). libfuzzer-sys builds libFuzzer from source with the system C++ compiler.
#
#   fuzz/libfuzzer.sh TARGET [RUNS] [extra libFuzzer flags…]
#   fuzz/libfuzzer.sh nbd_reply 10000000
#
# Targets: virtio_blk nbd_reply qmp_wire control vhost_user. The corpus grows in
# fuzz/corpus/TARGET (not committed); crashes land in fuzz/artifacts/TARGET/.
set -euo pipefail
target=${1:?usage: fuzz/libfuzzer.sh TARGET [RUNS] [libFuzzer flags]}
runs=${2:-1000000}
shift $(( $# >= 2 ? 2 : 1 ))
cd "$(dirname "$0")/.."
triple=$(rustc -vV | awk '/^host:/{print $2}')
# The target triple keeps these flags off build scripts (they do not link libFuzzer).
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks"
bin=fuzz-${target//_/-}
cargo build --release -q -p accel-fuzz --features libfuzzer --bin "$bin" \
    --target "$triple" --target-dir target/libfuzzer
mkdir -p "fuzz/corpus/$target" "fuzz/artifacts/$target"
exec "target/libfuzzer/$triple/release/$bin" -runs="$runs" -max_len=4096 \
    -artifact_prefix="fuzz/artifacts/$target/" "$@" "fuzz/corpus/$target"

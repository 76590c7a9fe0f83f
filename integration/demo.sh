#!/bin/bash
# The main job on a fresh machine: install what is needed, build, and run the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
./integration/setup.sh
cargo build --release -p acceld -p accelctl -p accel-integration
ACCELD_BIN="$PWD/target/release/acceld" ACCELCTL_BIN="$PWD/target/release/accelctl" \
  ./target/release/accel-integration demo "$@"

#!/usr/bin/env bash
# Sets up, builds, compiles the gpt-tiny example and trains it on the built-in
# synthetic data: the loss falls from about ln(256) = 5.5.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build/bin/tessel compile examples/gpt-tiny.json -o out/gpt-tiny
build/bin/tessel run out/gpt-tiny --steps "${STEPS:-100}"

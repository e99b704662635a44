#!/usr/bin/env bash
# Sets up, builds and runs the whole test suite (unit tests and lit tests,
# end-to-end training included) through ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cd build
ctest --output-on-failure -j"$(nproc)" "$@"

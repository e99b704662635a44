#!/usr/bin/env bash
# Installs what Tessel needs from Debian packages (only what is missing) and
# builds it into build/. Safe to run again: it does only what is left to do.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(cmake ninja-build g++ pkg-config ccache
  llvm-22-dev llvm-22-tools libmlir-22-dev mlir-22-tools
  nlohmann-json3-dev zlib1g-dev libicu-dev libopenblas-dev libopenmpi-dev openmpi-bin libgtest-dev
  python3 python3-numpy python3-regex python3-torch slurm-wlm munge chromium)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if [ ! -f build/build.ninja ]; then
  cmake -G Ninja -S . -B build -DCMAKE_BUILD_TYPE=Release
fi
jobs=$(nproc)
ninja -C build -j"$jobs"

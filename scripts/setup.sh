#!/usr/bin/env bash
# Installs what glake's build needs on Debian 12 (g++, cmake, make or ninja, Boost headers,
# doctest, zlib, python3), and what the fuzz stage needs: clang-14 with libclang-rt-14-dev
# (libFuzzer and the sanitizer runtimes) and python3-venv (Atheris goes into a venv in build/). Quiet and does nothing when all of it is present; runs `apt-get update`
# at most once; uses sudo when not root.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()

have_cmd() { command -v "$1" >/dev/null 2>&1; }
have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }

have_cmd g++ || missing+=(g++)
have_cmd cmake || missing+=(cmake)
have_cmd make || have_cmd ninja || missing+=(make)
have_cmd python3 || missing+=(python3)
have_pkg libboost-dev || missing+=(libboost-dev)
have_pkg doctest-dev || missing+=(doctest-dev)
have_pkg zlib1g-dev || missing+=(zlib1g-dev)
have_cmd clang++-14 || missing+=(clang-14)
have_pkg libclang-rt-14-dev || missing+=(libclang-rt-14-dev)
python3 -c "import ensurepip, venv" 2>/dev/null || missing+=(python3-venv)

if ((${#missing[@]} > 0)); then
  if ! have_cmd apt-get; then
    echo "setup.sh: missing ${missing[*]}, and there is no apt-get here; install them by hand" >&2
    exit 1
  fi
  sudo=()
  if [[ $(id -u) -ne 0 ]]; then
    if have_cmd sudo; then
      sudo=(sudo)
    else
      echo "setup.sh: missing ${missing[*]}; run as root or install sudo" >&2
      exit 1
    fi
  fi
  echo "setup.sh: installing ${missing[*]}"
  "${sudo[@]}" apt-get update -qq
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# glake's CMakeLists needs CMake 3.25 (Debian 12 ships 3.25.1).
cmake_version=$(cmake --version | sed -n '1s/[^0-9]*\([0-9][0-9.]*\).*/\1/p')
if [[ "$(printf '%s\n' 3.25 "$cmake_version" | sort -V | head -n1)" != 3.25 ]]; then
  echo "setup.sh: cmake $cmake_version is older than 3.25, which glake needs" >&2
  exit 1
fi

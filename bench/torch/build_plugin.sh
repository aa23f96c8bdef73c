#!/usr/bin/env bash
# Builds the PyTorch plug-in, libglake_torch.so, with one compiler call: no CMake, no nvcc, no
# Boost package (the GPU machine has none; its headers come from .device-deps/include, a copy of
# the Boost headers glake includes (bench/torch/README.md), or from the system). glake_torch finds
# the result in build/torch/ by itself.
#
#   bench/torch/build_plugin.sh [OUT]        default OUT: build/torch/libglake_torch.so
#   bench/torch/build_plugin.sh --size-cache   the control allocator of finetune.py's `sizecache`
#                                              runs instead: build/torch/libsize_cache.so
#   bench/torch/build_plugin.sh --allocator-timing   finetune.py --allocator-timing's instrument:
#                                              build/torch/libglake_allocator_timing.so (needs torch)
#
# CUDA_HOME (default /usr/local/cuda), CXX (default g++), BOOST_INCLUDEDIR (Boost's headers where
# they are not on the compiler's path), PYTHON (whose torch, if it imports one; default python3),
# GLAKE_TORCH_DIR and GLAKE_TORCH_CXX11_ABI (torch's package directory and C++ ABI, instead of
# asking PYTHON) and GLAKE_TORCH_C10=0 (no torch) are honoured.
set -euo pipefail
cd "$(dirname "$0")/../.."
cuda=${CUDA_HOME:-/usr/local/cuda}
cxx=${CXX:-g++}
if [[ ${1:-} == --size-cache ]]; then
  mkdir -p build/torch
  "$cxx" -std=c++17 -O2 -shared -fPIC -Wall -Wextra -isystem "$cuda/include" bench/torch/size_cache_allocator.cpp \
    -L"$cuda/lib64" -L"$cuda/lib" -lcudart -o build/torch/libsize_cache.so
  echo "built build/torch/libsize_cache.so"
  exit 0
fi
if [[ ${1:-} == --allocator-timing ]]; then
  # Against the torch that python3 imports: its headers, its libc10*, its C++ ABI. The same
  # private-runtime flags as the plug-in below.
  torch_dir=$(python3 -c "import os, torch; print(os.path.dirname(torch.__file__))")
  abi=$(python3 -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))")
  mkdir -p build/torch
  "$cxx" -std=c++17 -O2 -shared -fPIC -fvisibility=hidden -Wall -Wextra -D_GLIBCXX_USE_CXX11_ABI="$abi" \
    -isystem "$torch_dir/include" -isystem "$cuda/include" bench/torch/allocator_timing.cpp \
    -L"$torch_dir/lib" -lc10 -lc10_cuda -L"$cuda/lib64" -L"$cuda/lib" -lcudart -Wl,-rpath,"$torch_dir/lib" \
    -Wl,--exclude-libs,ALL -Wl,-Bsymbolic -o build/torch/libglake_allocator_timing.so
  echo "built build/torch/libglake_allocator_timing.so"
  exit 0
fi
out=${1:-build/torch/libglake_torch.so}
python=${PYTHON:-python3}
deps=()
[[ -d .device-deps/include ]] && deps=(-isystem .device-deps/include)
[[ -n ${BOOST_INCLUDEDIR:-} ]] && deps+=(-isystem "$BOOST_INCLUDEDIR")
if ! echo '#include <boost/intrusive/set.hpp>' | "$cxx" -std=c++20 -x c++ -fsyntax-only "${deps[@]}" - 2>/dev/null; then
  echo "build_plugin.sh: Boost's headers (boost/intrusive) not found: install them (Debian: libboost-dev)" \
       "or set BOOST_INCLUDEDIR to the directory holding boost/" >&2
  exit 1
fi
# Where python3 imports torch, the plug-in is built against its headers and libc10 (its C++ ABI):
# out of memory then reaches Python as torch.cuda.OutOfMemoryError. GLAKE_TORCH_C10=0 turns it off;
# GLAKE_TORCH_DIR and GLAKE_TORCH_CXX11_ABI name torch's package directory and ABI instead of asking
# python3. The rpath looks beside the plug-in first: a copy installed next to torch in
# site-packages finds its libc10.
# With torch, the native allocator (native_allocator.cpp: glake as torch's own CUDA allocator) is
# built in as well, against libtorch_cuda and libc10_cuda; GLAKE_TORCH_NATIVE=0 leaves it out.
c10=()
native=()
if [[ ${GLAKE_TORCH_C10:-1} != 0 ]]; then
  torch_dir=${GLAKE_TORCH_DIR:-}
  abi=${GLAKE_TORCH_CXX11_ABI:-}
  if [[ -z $torch_dir ]] &&
     torch_dir=$("$python" -c "import os, torch; print(os.path.dirname(torch.__file__))" 2>/dev/null); then
    abi=$("$python" -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))")
  fi
  if [[ -n $torch_dir ]]; then
    c10=(-DGLAKE_TORCH_WITH_C10=1 -D_GLIBCXX_USE_CXX11_ABI="${abi:-1}" -isystem "$torch_dir/include")
    if [[ ${GLAKE_TORCH_NATIVE:-1} != 0 ]]; then
      native=(-DGLAKE_TORCH_NATIVE=1 integrations/torch/native_allocator.cpp -L"$torch_dir/lib" -ltorch_cuda -lc10_cuda
              -L"$cuda/lib64" -L"$cuda/lib" -lcudart)
    fi
    c10+=("${native[@]}" -L"$torch_dir/lib" -lc10 '-Wl,-rpath,$ORIGIN/../torch/lib' -Wl,-rpath,"$torch_dir/lib")
  fi
fi
# The sources: integrations/torch/sources.txt, the one list (CMake reads it too).
mapfile -t sources < <(grep -v -e '^#' -e '^[[:space:]]*$' integrations/torch/sources.txt | sed 's|^|integrations/torch/|')
mkdir -p "$(dirname "$out")"
# --exclude-libs,ALL and -Bsymbolic: where the compiler links its C++ runtime statically (the GPU
# machine's g++ does), the copy inside the plug-in must stay private; exported, its symbols bind
# to the process's own libstdc++ (torch's) half-way and the first exception or string crashes.
# -lcuda links against the driver (its stub where the real one has no libcuda.so link); at run
# time the real libcuda.so.1 is loaded. GLAKE_CHECKED=1 as in the CMake build: bad frees are caught.
"$cxx" -std=c++20 -O2 -g -shared -fPIC -fvisibility=hidden -Wall -Wextra -DGLAKE_CHECKED=1 \
  -Iinclude -Iintegrations/torch "${deps[@]}" -isystem "$cuda/include" \
  "${sources[@]}" "${c10[@]}" \
  -L"$cuda/lib64" -L"$cuda/lib" -L"$cuda/lib64/stubs" -L"$cuda/lib/stubs" -lcuda \
  -Wl,--exclude-libs,ALL -Wl,-Bsymbolic -o "$out"
note=""
((${#c10[@]})) && note=", against torch (out of memory is torch.cuda.OutOfMemoryError)"
[[ " ${c10[*]} " == *" -DGLAKE_TORCH_NATIVE=1 "* ]] && note+=", with the native allocator"
echo "built $out ($("$cxx" --version | head -1))$note"

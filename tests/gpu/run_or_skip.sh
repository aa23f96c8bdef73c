#!/bin/sh
# Runs a GPU program (the GPU tests, examples/*.cu) where a CUDA driver and a GPU are present;
# otherwise says why and exits 77, which CTest reports as skipped (SKIP_RETURN_CODE).
program=$(basename "$1")
if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1'; then
  echo "$program skipped: no CUDA driver (libcuda.so.1) on this machine"
  exit 77
fi
if ! ls /dev/nvidia[0-9]* >/dev/null 2>&1; then
  echo "$program skipped: no GPU device (/dev/nvidia*) on this machine"
  exit 77
fi
exec "$@"

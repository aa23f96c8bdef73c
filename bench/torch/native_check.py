"""Builds the PyTorch plug-in with the native allocator against this Python's torch and runs its GPU
checks (integrations/torch/tests/test_native.py), in one command:

    python3 bench/torch/native_check.py            # build build/torch/libglake_torch.so, then check
    python3 bench/torch/native_check.py --no-build # check the library glake_torch finds
    python3 bench/torch/native_check.py --all      # also the older GPU checks of the plug-in

The build is bench/torch/build_plugin.sh (CUDA_HOME, CXX and BOOST_INCLUDEDIR honoured). Exit 0
when every check passed, 77 when they could not run (no GPU, no torch), else 1.
"""

import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(ROOT, "integrations", "torch", "tests")
LIBRARY = os.path.join(ROOT, "build", "torch", "libglake_torch.so")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-build", action="store_true", help="use the library already built")
    parser.add_argument("--all", action="store_true", help="also run torch_gpu_checks.py and the snapshot/graph checks")
    args = parser.parse_args()
    env = dict(os.environ, PYTHON=sys.executable)
    if not args.no_build:
        subprocess.run(["bash", os.path.join(ROOT, "bench", "torch", "build_plugin.sh"), LIBRARY], check=True, env=env)
        env["GLAKE_TORCH_LIBRARY"] = LIBRARY
    library = env.get("GLAKE_TORCH_LIBRARY")
    runs = [[sys.executable, os.path.join(TESTS, "test_native.py"), "--child"] + ([library] if library else [])]
    if args.all:
        for script in ("torch_gpu_checks.py", "torch_gpu_snapshot_graph_checks.py"):
            runs.append([sys.executable, os.path.join(TESTS, script)] + ([library] if library else []))
    codes = []
    for command in runs:
        print("==>", " ".join(command), flush=True)
        codes.append(subprocess.run(command, env=env).returncode)
    if any(code not in (0, 77) for code in codes):
        return 1
    return 77 if all(code == 77 for code in codes) else 0


if __name__ == "__main__":
    sys.exit(main())

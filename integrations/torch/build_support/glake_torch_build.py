"""The prerequisites of glake-torch's build, found before CMake runs: a dynamic-metadata provider
for scikit-build-core (pyproject.toml's [[tool.dynamic-metadata]]) that fills in the package's
dependencies and hands what it found to CMake (CMakeLists.txt, its part for pip).

libglake_torch.so is not a Python extension module (glake_torch loads it with ctypes and hands
it to PyTorch); it is compiled against the torch of the installing Python, and the package
depends on that torch (same major.minor: libc10's C++ ABI). Each prerequisite is found, printed
(`pip install -v` shows it) and checked; a missing one stops the build before anything is
compiled, with one line naming it and the variable that sets it:

  torch           imported by the installing Python, run as `python -I` so that pip's build
                  isolation (a PYTHONPATH overlay) does not hide it; GLAKE_TORCH_PYTHON names
                  another Python, GLAKE_TORCH_C10=0 builds without torch (out of memory is then
                  a RuntimeError, not torch.cuda.OutOfMemoryError)
  CUDA toolkit    $CUDA_HOME (default /usr/local/cuda), its include/cuda.h
  C++ compiler    $CXX (default g++), C++20
  Boost headers   on the compiler's path, or $BOOST_INCLUDEDIR

CMake receives them as environment variables: CUDA_HOME, CXX, GLAKE_TORCH_C10, and with torch
GLAKE_TORCH_DIR (torch's package folder) and GLAKE_TORCH_CXX11_ABI."""

import os
import re
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))

_TORCH_PROBE = """
import os, torch
print(torch.__version__)
print(os.path.dirname(torch.__file__))
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print(torch.version.cuda or "none")
"""


def _say(text):
    print(f"glake-torch: {text}", flush=True)


def _fail(text):
    raise SystemExit(f"glake-torch: {text}")


def find_torch():
    """The torch to build against, as {version, dir, abi, cuda, python}, or None with GLAKE_TORCH_C10=0."""
    if os.environ.get("GLAKE_TORCH_C10", "1") == "0":
        return None
    python = os.environ.get("GLAKE_TORCH_PYTHON") or sys.executable
    origin = "GLAKE_TORCH_PYTHON" if os.environ.get("GLAKE_TORCH_PYTHON") else "the installing Python"
    try:
        probe = subprocess.run([python, "-I", "-c", _TORCH_PROBE], capture_output=True, text=True, timeout=300)
    except OSError as error:
        _fail(f"cannot run {python} ({origin}): {error}")
    if probe.returncode != 0:
        lines = probe.stderr.strip().splitlines()
        _fail(
            f"{python} ({origin}) does not import torch ({lines[-1] if lines else 'no message'}). "
            "Install torch first (pip install torch), or set GLAKE_TORCH_PYTHON to a Python that imports it, "
            "or GLAKE_TORCH_C10=0 to build without torch (out of memory is then a RuntimeError, "
            "not torch.cuda.OutOfMemoryError)"
        )
    version, directory, abi, cuda = probe.stdout.strip().splitlines()[-4:]
    return {"version": version, "dir": directory, "abi": abi, "cuda": cuda, "python": python}


def torch_requirement(torch):
    """The torch whose libc10 the library links: same major.minor (its C++ ABI changes between them)."""
    if torch is None:
        return []
    match = re.match(r"(\d+)\.(\d+)", torch["version"])
    return [f"torch=={match.group(1)}.{match.group(2)}.*"] if match else ["torch"]


def cuda_toolkit():
    """$CUDA_HOME (default /usr/local/cuda) and its version from cuda.h; exits when cuda.h is missing."""
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    header = os.path.join(home, "include", "cuda.h")
    if not os.path.isfile(header):
        origin = "CUDA_HOME" if os.environ.get("CUDA_HOME") else "the default, /usr/local/cuda (CUDA_HOME is unset)"
        _fail(f"the CUDA toolkit was not found: no {header} ({origin}). Install the CUDA toolkit "
              "(nvcc is not needed), or set CUDA_HOME to its directory")
    with open(header, errors="replace") as text:
        match = re.search(r"#define\s+CUDA_VERSION\s+(\d+)", text.read())
    version = f"{int(match.group(1)) // 1000}.{int(match.group(1)) % 1000 // 10}" if match else "unknown"
    return home, version


def compiler():
    cxx = os.environ.get("CXX") or "g++"
    path = shutil.which(cxx)
    if path is None:
        _fail(f"the C++ compiler {cxx!r} was not found: install g++ (10 or later, for C++20), or set CXX")
    version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout.splitlines()
    return path, version[0] if version else path


def check_boost(cxx):
    flags = []
    for directory in (os.path.join(ROOT, ".device-deps", "include"), os.environ.get("BOOST_INCLUDEDIR")):
        if directory and os.path.isdir(directory):
            flags += ["-isystem", directory]
    probe = subprocess.run([cxx, "-std=c++20", "-x", "c++", "-fsyntax-only", *flags, "-"],
                           input="#include <boost/intrusive/set.hpp>\n", capture_output=True, text=True)
    if probe.returncode != 0:
        _fail("Boost's headers (boost/intrusive/set.hpp) were not found: install them (Debian: libboost-dev), "
              "or set BOOST_INCLUDEDIR to the directory holding boost/")


def prerequisites(report):
    """Finds and checks everything, exports it for CMake, and returns the torch found (or None)."""
    if not os.path.isfile(os.path.join(ROOT, "include", "glake", "glake.hpp")):
        _fail(f"glake's headers are not at {os.path.join(ROOT, 'include')}; install from a checkout of the "
              "glake repository (pip install <glake>/integrations/torch)")
    cuda_home, cuda_version = cuda_toolkit()
    cxx, cxx_version = compiler()
    check_boost(cxx)
    torch = find_torch()
    os.environ.update(CUDA_HOME=cuda_home, CXX=cxx, GLAKE_TORCH_C10="0" if torch is None else "1")
    if torch is not None:
        os.environ.update(GLAKE_TORCH_DIR=torch["dir"], GLAKE_TORCH_CXX11_ABI=torch["abi"])
    if report:
        _say(f"CUDA toolkit {cuda_version} at {cuda_home}")
        _say(f"compiler {cxx_version}")
        if torch is None:
            _say("torch: not used (GLAKE_TORCH_C10=0): out of memory raises RuntimeError")
        else:
            _say(f"torch {torch['version']} (CUDA {torch['cuda']}) at {torch['dir']}, from {torch['python']}")
            if torch["cuda"] not in ("none", cuda_version):
                _say(f"note: torch was built with CUDA {torch['cuda']}, the toolkit here is {cuda_version}; "
                     "the plug-in only uses the driver API, which the driver serves for both")
        _say("compiling libglake_torch.so (a few minutes on two cores) ...")
    return torch


# The dynamic-metadata protocol (scikit-build-core 1.x): build_state is told first, then
# dynamic_metadata returns the fields this provider fills in. The prerequisites are checked from
# the metadata hook on (pip calls it first), so a missing one stops pip before anything is
# compiled; they are printed when the wheel itself is built. An SDist checks nothing.
_state = "wheel"


def build_state(state):
    global _state
    _state = state


def dynamic_metadata(settings, project):
    if _state == "sdist":
        return {"dependencies": []}
    torch = prerequisites(report=_state in ("wheel", "editable"))
    return {"dependencies": torch_requirement(torch)}


def dynamic_wheel(settings):
    """The dependencies are the wheel's: they name the torch it is built against."""
    return {"dependencies": True}

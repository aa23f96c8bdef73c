"""Builds libglake_torch.so into the glake_torch package (pyproject.toml has the rest of the
metadata). The library is not a Python extension module (glake_torch loads it with ctypes and
hands it to PyTorch): bench/torch/build_plugin.sh, the repository's one recipe for it, compiles
the sources listed in sources.txt, and the wheel is marked as platform-specific.

Before compiling, the prerequisites are found, printed (`pip install -v` shows them) and checked;
a missing one stops the build with one line naming it and the variable that sets it:

  torch           imported by the installing Python, run as `python -I` so that pip's build
                  isolation (a PYTHONPATH overlay) does not hide it; GLAKE_TORCH_PYTHON names
                  another Python, GLAKE_TORCH_C10=0 builds without torch (out of memory is then
                  a RuntimeError, not torch.cuda.OutOfMemoryError)
  CUDA toolkit    $CUDA_HOME (default /usr/local/cuda), its include/cuda.h
  C++ compiler    $CXX (default g++), C++20
  Boost headers   on the compiler's path, or $BOOST_INCLUDEDIR

The wheel depends on the torch it was built against (same major.minor: libc10's C++ ABI)."""

import os
import re
import shutil
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RECIPE = os.path.join(ROOT, "bench", "torch", "build_plugin.sh")

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


def _find_torch():
    """The torch to build against, as {version, dir, abi, cuda}, or None with GLAKE_TORCH_C10=0."""
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


def _torch_requirement(torch):
    """The torch whose libc10 the library links: same major.minor (its C++ ABI changes between them)."""
    if torch is None:
        return []
    match = re.match(r"(\d+)\.(\d+)", torch["version"])
    return [f"torch=={match.group(1)}.{match.group(2)}.*"] if match else ["torch"]


def _cuda_toolkit():
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


def _compiler():
    cxx = os.environ.get("CXX") or "g++"
    path = shutil.which(cxx)
    if path is None:
        _fail(f"the C++ compiler {cxx!r} was not found: install g++ (10 or later, for C++20), or set CXX")
    version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout.splitlines()
    return cxx, version[0] if version else path


def _check_boost(cxx):
    flags = []
    for directory in (os.path.join(ROOT, ".device-deps", "include"), os.environ.get("BOOST_INCLUDEDIR")):
        if directory and os.path.isdir(directory):
            flags += ["-isystem", directory]
    probe = subprocess.run([cxx, "-std=c++20", "-x", "c++", "-fsyntax-only", *flags, "-"],
                           input="#include <boost/intrusive/set.hpp>\n", capture_output=True, text=True)
    if probe.returncode != 0:
        _fail("Boost's headers (boost/intrusive/set.hpp) were not found: install them (Debian: libboost-dev), "
              "or set BOOST_INCLUDEDIR to the directory holding boost/")


# pip runs this file anew for each hook (requirements, metadata, wheel): the prerequisites are
# checked from the metadata hook on, so a missing one stops the build before anything is
# compiled, and the wheel's metadata names the torch it is built against.
BUILDING = not any(command in sys.argv for command in ("sdist", "egg_info", "clean", "--version", "--name"))
CUDA_HOME, CUDA_VERSION = _cuda_toolkit() if BUILDING else (None, None)
CXX, CXX_VERSION = _compiler() if BUILDING else (None, None)
if BUILDING:
    _check_boost(CXX)
TORCH = _find_torch() if BUILDING else None


class build_with_library(build_py):
    def run(self):
        super().run()
        if not os.path.isfile(RECIPE):
            _fail(f"{RECIPE} not found; install from a checkout of the glake repository "
                  "(pip install <glake>/integrations/torch)")
        _say(f"CUDA toolkit {CUDA_VERSION} at {CUDA_HOME}")
        _say(f"compiler {CXX_VERSION}")
        env = dict(os.environ, CUDA_HOME=CUDA_HOME, CXX=CXX, GLAKE_TORCH_C10="0")
        if TORCH is None:
            _say("torch: not used (GLAKE_TORCH_C10=0): out of memory raises RuntimeError")
        else:
            _say(f"torch {TORCH['version']} (CUDA {TORCH['cuda']}) at {TORCH['dir']}, from {TORCH['python']}")
            env.update(GLAKE_TORCH_C10="1", GLAKE_TORCH_DIR=TORCH["dir"], GLAKE_TORCH_CXX11_ABI=TORCH["abi"])
            if TORCH["cuda"] not in ("none", CUDA_VERSION):
                _say(f"note: torch was built with CUDA {TORCH['cuda']}, the toolkit here is {CUDA_VERSION}; "
                     "the plug-in only uses the driver API, which the driver serves for both")
        out = os.path.join(os.path.abspath(self.build_lib), "glake_torch", "libglake_torch.so")
        _say("compiling libglake_torch.so (a few minutes on two cores) ...")
        if subprocess.run(["bash", RECIPE, out], env=env).returncode != 0:
            _fail("compiling libglake_torch.so failed (bench/torch/build_plugin.sh; its output is above)")


class platform_distribution(Distribution):
    def has_ext_modules(self):
        return True


setup(
    cmdclass={"build_py": build_with_library},
    distclass=platform_distribution,
    install_requires=_torch_requirement(TORCH),
)

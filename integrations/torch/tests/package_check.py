"""The command users type, `pip install <glake>/integrations/torch` (pip's build isolation on; -v
only shows the build's output), installs glake-torch with libglake_torch.so inside, which the
installed glake_torch finds from any directory. Run by CTest (torch_plugin.package) where the CUDA
toolkit is.

WORK (the first argument) gets a fresh venv that sees this Python's packages (a .pth file naming
its site-packages, which also works where this Python is itself a venv's). Where this Python imports torch, the build must find that torch past
pip's isolation: the library links torch's libc10 (out of memory is torch.cuda.OutOfMemoryError,
checked where a GPU is) and the package depends on that torch. Where it does not, the same
command must stop before compiling, saying that torch is missing and how to build without it;
the check then builds with GLAKE_TORCH_C10=0. Without the NVIDIA driver, stats() must raise
glake_torch.DriverNotFoundError.

pip's isolated build environment installs the build backend, scikit-build-core, from the package
index; each run keeps a copy in a wheelhouse (WORK/wheelhouse, or $GLAKE_WHEELHOUSE), which pip
uses instead (PIP_NO_INDEX=1, PIP_FIND_LINKS) when the index cannot be reached. Exit 77 (skipped)
when the CUDA toolkit or the venv is not available, or scikit-build-core neither from the index nor
from the wheelhouse; 1 when the build or a check fails."""

import os
import shutil
import site
import subprocess
import sys
import textwrap
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.dirname(HERE)

STATS_WITHOUT_DRIVER = textwrap.dedent(
    """
    import glake_torch
    try:
        glake_torch.stats()
        print("driver present: stats() works")
    except glake_torch.DriverNotFoundError as error:
        print("no driver:", error)
    """
)

OOM_ON_GPU = textwrap.dedent(
    """
    import glake_torch
    glake_torch.enable()
    import torch
    if not torch.cuda.is_available():
        print("no GPU: out of memory not checked")
        raise SystemExit(0)
    x = torch.ones(1 << 20, device="cuda")
    hog, caught = [], None
    try:
        while True:
            hog.append(torch.empty(8 << 30, dtype=torch.uint8, device="cuda"))
    except Exception as error:
        caught = error
    del hog
    assert isinstance(caught, torch.cuda.OutOfMemoryError), f"{type(caught).__name__}: {caught}"
    print("out of memory is torch.cuda.OutOfMemoryError:", str(caught).splitlines()[0][:120])
    """
)


def fail(text):
    print(f"package check FAILED: {text}")
    return 1


def main():
    work = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "package-check")
    cuda_h = os.path.join(os.environ.get("CUDA_HOME") or "/usr/local/cuda", "include", "cuda.h")
    if not os.path.isfile(cuda_h):
        print(f"package check skipped: no CUDA toolkit ({cuda_h} not found; CUDA_HOME sets its directory)")
        return 77
    venv = os.path.join(work, "venv")
    python = os.path.join(venv, "bin", "python")
    shutil.rmtree(venv, ignore_errors=True)
    if subprocess.run([sys.executable, "-m", "venv", venv]).returncode != 0:
        print("package check skipped: python3 -m venv failed")
        return 77
    inner = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(inner, "outer_site_packages.pth"), "w") as pth:
        pth.write("\n".join(site.getsitepackages()) + "\n")
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("GLAKE_TORCH_C10", None)
    env.pop("GLAKE_TORCH_PYTHON", None)
    pip = [python, "-m", "pip"]
    # The build backend for pip's isolated build environment: from the index, where it answers
    # (its wheels are kept in the wheelhouse), else from the wheelhouse alone.
    wheelhouse = os.path.abspath(os.environ.get("GLAKE_WHEELHOUSE") or os.path.join(work, "wheelhouse"))
    backend = "scikit-build-core>=1.1"
    # ninja too: scikit-build-core asks for its wheel where the system has no ninja.
    probe = subprocess.run(pip + ["download", "-q", "--timeout", "15", "--retries", "1", "-d", wheelhouse, backend,
                                  "ninja"],
                           env=env, capture_output=True, text=True, timeout=600)
    if probe.returncode != 0:
        kept = subprocess.run(pip + ["download", "-q", "--no-index", "--find-links", wheelhouse, "-d",
                                     os.path.join(work, "probe"), backend], env=env, capture_output=True, text=True)
        if kept.returncode != 0:
            print(f"package check skipped: {backend} (pip's build backend) cannot be fetched from the package index "
                  f"and is not in the wheelhouse {wheelhouse}: run once with the index reachable, or put its wheels "
                  "and their dependencies there (pip download -d DIR scikit-build-core ninja; GLAKE_WHEELHOUSE names DIR)")
            return 77
        print(f"the package index is not reachable: pip's isolated build takes {backend} from {wheelhouse}")
        env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=wheelhouse)
    torch = subprocess.run([python, "-I", "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    torch_version = torch.stdout.strip() if torch.returncode == 0 else None

    started = time.monotonic()
    if torch_version is None:
        refused = subprocess.run(pip + ["install", PACKAGE], env=env, capture_output=True, text=True, timeout=600)
        output = refused.stdout + refused.stderr
        if refused.returncode == 0:
            return fail("pip install without torch succeeded; it must stop and say that torch is missing")
        for needed in ("does not import torch", "GLAKE_TORCH_C10=0", "pip install torch"):
            if needed not in output:
                return fail(f"pip install without torch failed without saying {needed!r}:\n{output}")
        print(f"without torch, pip install stops saying why ({time.monotonic() - started:.0f} s); "
              "building with GLAKE_TORCH_C10=0")
        env["GLAKE_TORCH_C10"] = "0"
    built = subprocess.run(pip + ["install", "-v", PACKAGE], env=env, capture_output=True, text=True, timeout=1500)
    output = built.stdout + built.stderr
    if built.returncode != 0:
        return fail(f"pip install -v {PACKAGE}:\n{output[-6000:]}")
    print(f"pip install -v integrations/torch: {time.monotonic() - started:.0f} s")
    found = [line.strip() for line in output.splitlines() if line.strip().startswith("glake-torch:")]
    print("\n".join(f"  {line}" for line in found))
    for needed in ("glake-torch: CUDA toolkit", "glake-torch: compiler", "glake-torch: torch"):
        if not any(line.startswith(needed) for line in found):
            return fail(f"the build did not print {needed!r}")
    if torch_version and not any(line.startswith(f"glake-torch: torch {torch_version}") for line in found):
        return fail(f"the build did not use this Python's torch {torch_version}")

    show = subprocess.run([python, "-c", textwrap.dedent(
        """
        import glake_torch, importlib.metadata as m, os
        d = m.distribution("glake-torch")
        print(glake_torch.library_path())
        print(glake_torch.__version__, d.version)
        print(d.read_text("WHEEL"))
        print(d.read_text("METADATA"))
        """)], cwd=work, capture_output=True, text=True)
    if show.returncode != 0:
        return fail(f"the installed glake_torch does not import:\n{show.stderr}")
    library, versions, metadata = show.stdout.split("\n", 2)
    if not library.startswith(venv) or not os.path.isfile(library):
        return fail(f"the installed glake_torch did not find its own library: {library}")
    if "-none-any" in metadata:
        return fail("the wheel is tagged pure Python, but it holds a native library")
    package_version, dist_version = versions.split()
    if package_version != dist_version:
        return fail(f"glake_torch.__version__ {package_version} differs from the package's {dist_version}")
    if "License-Expression: Apache-2.0" not in metadata or "License-File: LICENSE" not in metadata:
        return fail(f"the package's metadata lacks the Apache-2.0 license and its file:\n{metadata[:2000]}")
    with open(library, "rb") as binary:
        links_c10 = b"libc10.so" in binary.read()
    if torch_version:
        major_minor = ".".join(torch_version.split(".")[:2])
        if not links_c10:
            return fail(f"{library} does not link torch's libc10 although torch {torch_version} is installed")
        if f"Requires-Dist: torch=={major_minor}.*" not in metadata:
            return fail(f"the package does not depend on torch=={major_minor}.*:\n{metadata[:2000]}")
    elif links_c10:
        return fail(f"{library} links libc10 although it was built with GLAKE_TORCH_C10=0")

    stats = subprocess.run([python, "-c", STATS_WITHOUT_DRIVER], cwd=work, capture_output=True, text=True)
    if stats.returncode != 0:
        return fail(f"stats() without torch raised something other than DriverNotFoundError:\n{stats.stderr}")
    print(f"  {stats.stdout.strip()}")
    if torch_version and stats.stdout.startswith("driver present"):
        oom = subprocess.run([python, "-c", OOM_ON_GPU], cwd=work, capture_output=True, text=True, timeout=600)
        if oom.returncode != 0:
            return fail(f"out of memory on the GPU:\n{oom.stdout}{oom.stderr}")
        print(f"  {oom.stdout.strip()}")
    print(f"package check: glake-torch {dist_version} installed by pip install integrations/torch "
          f"({'against torch ' + torch_version if torch_version else 'without torch'}); glake_torch loads {library}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

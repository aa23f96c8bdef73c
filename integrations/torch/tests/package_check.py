"""pip builds the plug-in's package: a wheel of glake-torch with libglake_torch.so inside, which
glake_torch finds from any directory once installed. Run by CTest (torch_plugin.package) where the
CUDA toolkit is: a venv in WORK (the first argument) gets setuptools and wheel from the package
index, then `pip wheel` and `pip install` of integrations/torch run in it. Exit 77 (skipped) when
the venv or the index is not available; 1 when the build or a check fails."""

import os
import subprocess
import sys
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.dirname(HERE)


def main():
    work = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "package-check")
    venv = os.path.join(work, "venv")
    python = os.path.join(venv, "bin", "python")
    if not os.path.isfile(python) and subprocess.run([sys.executable, "-m", "venv", venv]).returncode != 0:
        print("package check skipped: python3 -m venv failed")
        return 77
    pip = [python, "-m", "pip", "--disable-pip-version-check", "-q"]
    if subprocess.run(pip + ["install", "setuptools>=61", "wheel"], timeout=600).returncode != 0:
        print("package check skipped: setuptools and wheel could not be installed (no package index?)")
        return 77
    wheels = os.path.join(work, "wheels")
    if subprocess.run(pip + ["wheel", "--no-build-isolation", "--no-deps", "-w", wheels, PACKAGE], timeout=900).returncode != 0:
        print("package check FAILED: pip wheel integrations/torch")
        return 1
    built = [w for w in os.listdir(wheels) if w.startswith("glake_torch-") and w.endswith(".whl")]
    if len(built) != 1:
        print(f"package check FAILED: expected one glake_torch wheel in {wheels}, found {built}")
        return 1
    names = zipfile.ZipFile(os.path.join(wheels, built[0])).namelist()
    for needed in ("glake_torch/__init__.py", "glake_torch/libglake_torch.so"):
        if needed not in names:
            print(f"package check FAILED: {built[0]} lacks {needed} (has {names})")
            return 1
    if "-none-any" in built[0]:
        print(f"package check FAILED: {built[0]} is tagged pure Python, but it holds a native library")
        return 1
    if subprocess.run(pip + ["install", "--no-deps", "--force-reinstall", os.path.join(wheels, built[0])]).returncode != 0:
        print("package check FAILED: pip install of the wheel")
        return 1
    found = subprocess.run([python, "-c", "import glake_torch; print(glake_torch.library_path())"],
                           cwd=work, capture_output=True, text=True)
    if found.returncode != 0 or not found.stdout.strip().startswith(venv):
        print(f"package check FAILED: the installed glake_torch did not find its own library: {found.stdout}{found.stderr}")
        return 1
    print(f"package check: {built[0]} built and installed; glake_torch loads {found.stdout.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Builds libglake_torch.so into the glake_torch package (see pyproject.toml). The library is not a
Python extension module (glake_torch loads it with ctypes and hands it to PyTorch), so it is
compiled by bench/torch/build_plugin.sh, the repository's one recipe for it, and the wheel is
marked as platform-specific."""

import os
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RECIPE = os.path.join(ROOT, "bench", "torch", "build_plugin.sh")


class build_with_library(build_py):
    def run(self):
        super().run()
        if not os.path.isfile(RECIPE):
            raise SystemExit(
                f"glake-torch: {RECIPE} not found; install from a checkout of the glake repository "
                "(pip install <glake>/integrations/torch)"
            )
        out = os.path.join(os.path.abspath(self.build_lib), "glake_torch", "libglake_torch.so")
        subprocess.run(["bash", RECIPE, out], check=True, env=dict(os.environ, PYTHON=sys.executable))


class platform_distribution(Distribution):
    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": build_with_library}, distclass=platform_distribution)

"""The wheel carries the top-level data folders inside the package, as nanoqwen/_data/ (found by
nanoqwen/paths.py), so that an installed nanoqwen never reads a source checkout. Everything else is in
pyproject.toml."""

import glob
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

# Data folder -> the files of it that ship (tuner progress and user results live under the cache root).
DATA = {"templates": ("*.cu.j2", "*.cuh", "*.cu.inc"), "config": ("*.yaml",), "tune": ("*.yaml", "*.json")}


class BuildPyWithData(build_py):
    def run(self):
        super().run()
        for folder, patterns in DATA.items():
            dest = os.path.join(self.build_lib, "nanoqwen", "_data", folder)
            shutil.rmtree(dest, ignore_errors=True)   # a file deleted from the checkout must not ship stale
            self.mkpath(dest)
            for pattern in patterns:
                for src in sorted(glob.glob(os.path.join(folder, pattern))):
                    self.copy_file(src, dest)


setup(cmdclass={"build_py": BuildPyWithData})

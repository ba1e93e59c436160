"""The build's one step beyond setup.cfg: the module's types for its users' type checkers.

PEP 561 lets a package say it is typed (a py.typed marker), but not a bare
module such as createos_exec.py. It does recognise stub-only packages, so
the wheel also holds `createos_exec-stubs/__init__.pyi`, copied from the
module when the wheel is built: mypy and pyright read it, Python never
imports it, and the module itself stays the one file that is vendored. An
editable install needs no copy: it is the checkout.
"""

from __future__ import annotations

import os
from typing import List

from setuptools import setup
from setuptools.command.build_py import build_py

MODULE = "createos_exec.py"
STUBS = "createos_exec-stubs"


class BuildWithStubs(build_py):
    """build_py, plus the stub-only package copied from the module."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = os.path.join(self.build_lib, STUBS)
        self.mkpath(target)
        self.copy_file(MODULE, os.path.join(target, "__init__.pyi"))

    def get_outputs(self, include_bytecode: bool = True) -> List[str]:
        stub = os.path.join(self.build_lib, STUBS, "__init__.pyi")
        return [*super().get_outputs(include_bytecode), stub]


setup(cmdclass={"build_py": BuildWithStubs})

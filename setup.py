"""Ships fdg_schedule's start-up hook, a .pth file at the root of site-packages, in wheels and editable installs.

Everything else about the package is in pyproject.toml. The hook is one line that Python's ``site``
runs at interpreter start (see Note [the start-up hook] in fdg_schedule/runtime/install.py).
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_NAME = "fdg_schedule_autoinstall.pth"
PTH_LINE = "import _fdg_schedule_autoinstall; _fdg_schedule_autoinstall.watch()\n"


class BuildPyWithStartupHook(build_py):
    """``build_py`` that also writes the .pth file next to the top-level packages.

    A wheel ships ``build_lib``. An editable wheel (PEP 660, ``pip install -e``) ships only setuptools'
    own path hook from ``build_lib`` plus whatever lands in the ``install`` command's ``install_lib``,
    which setuptools points at the root of the editable wheel; so in editable mode the file goes there.
    """

    def run(self) -> None:
        super().run()
        target = self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
        os.makedirs(target, exist_ok=True)
        with open(os.path.join(target, PTH_NAME), "w", encoding="ascii") as pth:
            pth.write(PTH_LINE)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = list(super().get_outputs(include_bytecode))
        return outputs if self.editable_mode else [*outputs, os.path.join(self.build_lib, PTH_NAME)]


setup(cmdclass={"build_py": BuildPyWithStartupHook})

"""hvd-compress's build step; the metadata is in setup.cfg and pyproject.toml.

setup.cfg cannot say one thing: the example scripts, whose source is the
repository's top-level ``torch_examples/`` and ``tf_examples/``, are copied into
the package as ``hvd_compress/tools/examples/<folder>/`` so that
``hvd-compress-compare`` can launch them from an installed package, not only
from a checkout.  An editable install gets no copy: it runs the checkout's own.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

EXAMPLE_FOLDERS = ("torch_examples", "tf_examples")
PACKAGED = os.path.join("hvd_compress", "tools", "examples")


def _example_scripts():
    """(source, path inside the package tree) for every example script."""
    pairs = []
    for folder in EXAMPLE_FOLDERS:
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"{folder}/ is missing: hvd-compress-compare needs the example "
                                    "scripts; build from the repository or an sdist made from it")
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py"):
                pairs.append((os.path.join(folder, name), os.path.join(PACKAGED, folder, name)))
    return pairs


class BuildPyWithExamples(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for source, target in _example_scripts():
            target = os.path.join(self.build_lib, target)
            self.mkpath(os.path.dirname(target))
            self.copy_file(source, target, preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if getattr(self, "editable_mode", False):
            return outputs
        return outputs + [os.path.join(self.build_lib, target) for _, target in _example_scripts()]


setup(cmdclass={"build_py": BuildPyWithExamples})

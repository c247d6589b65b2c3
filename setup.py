"""The one compiled part of kvtrace: the per-token logits helper both engine patches share.

Everything else is configured in pyproject.toml.  The extension is optional: where it cannot be
built (no C compiler), the install still succeeds and kvtrace uses its pure-numpy twin, which gives
bit-identical results (patches/rowstats.py).
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# Bit-identical results on every machine: no fused multiply-add contraction (see _rowstats.c).
UNIX_FLAGS = ["-O3", "-ffp-contract=off"]


class BuildExt(build_ext):
    def build_extensions(self):
        if self.compiler.compiler_type == "unix":
            for extension in self.extensions:
                extension.extra_compile_args = [*extension.extra_compile_args, *UNIX_FLAGS]
        super().build_extensions()


setup(
    ext_modules=[
        Extension("kvtrace.patches._rowstats", ["patches/_rowstats.c"],
                  depends=["patches/_rowstats_kernels.h"], optional=True),
    ],
    cmdclass={"build_ext": BuildExt},
)

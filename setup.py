"""kvtrace's two compiled parts: the per-token logits helper both engine patches share, and the
recorder's hashing of token ids in their place.

Everything else is configured in pyproject.toml.  Both extensions are optional: where they cannot
be built (no C compiler), the install still succeeds and kvtrace uses their pure-numpy twins, which
give bit-identical results (patches/rowstats.py, kvtrace/recording/capture.py).
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
        Extension("kvtrace.recording._placehash", ["kvtrace/recording/_placehash.c"], optional=True),
    ],
    cmdclass={"build_ext": BuildExt},
)

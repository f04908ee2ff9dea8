"""overlap-optim: per-table and per-layer optimizers for TorchRec, exactly torch.optim.

Install through ``make`` (see README). torchrec's metadata asks for the CUDA
``fbgemm-gpu``, which breaks ``fbgemm-gpu-cpu``, so the Makefile installs the
stack explicitly and this package with ``--no-deps``. The pins live in
``requirements/``; this file reads them so there is one list.

The compiled operators (``overlap_optim/csrc``, :mod:`overlap_optim.compiled`) are built here,
with torch's own extension builder, when torch and a C++ compiler are present. They are
optional: without them every caller runs its pure-torch path, and the install succeeds.
"""

from pathlib import Path

from setuptools import find_packages, setup

_REQ = Path(__file__).parent / "requirements"
_CSRC = Path(__file__).parent / "overlap_optim" / "csrc"


def _extensions() -> tuple[list, dict]:
    """The optional compiled extension, and the build command that builds it (none without torch)."""
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        return [], {}
    # -fopenmp: at::parallel_for runs on torch's own OpenMP pool (the same libgomp.so.1).
    # -fno-math-errno: sqrt need not set errno, so it vectorizes; no result changes.
    flags = ["-O3", "-fopenmp", "-fno-math-errno"]
    extension = CppExtension(
        "overlap_optim._compiled", [f"overlap_optim/csrc/{p.name}" for p in sorted(_CSRC.glob("*.cpp"))],
        extra_compile_args=flags, extra_link_args=["-fopenmp"], optional=True,
    )
    return [extension], {"build_ext": BuildExtension.with_options(use_ninja=False)}


def _pins(name: str) -> list[str]:
    lines = (_REQ / name).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


_EXTENSIONS, _COMMANDS = _extensions()

setup(
    name="overlap-optim",
    version="0.1.0",
    description="Per-parameter optimizers that run during backward for TorchRec, exactly torch.optim",
    packages=find_packages(include=["overlap_optim", "overlap_optim.*", "sharders", "sharders.*"]),
    python_requires=">=3.10",
    install_requires=_pins("stack.txt") + _pins("torchrec.txt") + _pins("runtime.txt"),
    ext_modules=_EXTENSIONS,
    cmdclass=_COMMANDS,
    extras_require={"test": _pins("test.txt"), "examples": _pins("examples.txt"), "layerwise": _pins("layerwise.txt")},
)

"""overlap-optim: per-table and per-layer optimizers for TorchRec, exactly torch.optim.

Install through ``make`` (see README). torchrec's metadata asks for the CUDA
``fbgemm-gpu``, which breaks ``fbgemm-gpu-cpu``, so the Makefile installs the
stack explicitly and this package with ``--no-deps``. The pins live in
``requirements/``; this file reads them so there is one list.
"""

from pathlib import Path

from setuptools import find_packages, setup

_REQ = Path(__file__).parent / "requirements"


def _pins(name: str) -> list[str]:
    lines = (_REQ / name).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


setup(
    name="overlap-optim",
    version="0.1.0",
    description="Per-parameter optimizers that run during backward for TorchRec, exactly torch.optim",
    packages=find_packages(include=["overlap_optim", "overlap_optim.*", "sharders", "sharders.*"]),
    python_requires=">=3.10",
    install_requires=_pins("stack.txt") + _pins("torchrec.txt") + _pins("runtime.txt"),
    extras_require={"test": _pins("test.txt"), "examples": _pins("examples.txt"), "layerwise": _pins("layerwise.txt")},
)

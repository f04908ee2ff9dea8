"""Saving a benchmark's figure: one PNG beside its results, the name its report links."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["finish_axes", "saved"]


def finish_axes(*axes: Any) -> None:
    """A light grid and the legend on each of ``axes``."""
    for axis in axes:
        axis.grid(alpha=0.3)
        axis.legend()


def saved(fig: Any, out: Path, name: str) -> list[str]:
    """Lay ``fig`` out, write it to ``out / name`` (100 dpi) and close it; the file names to report."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(out / name, dpi=100)
    plt.close(fig)
    return [name]

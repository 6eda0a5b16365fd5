"""Plots of the benchmark suites: matplotlib on the Agg backend (no screen), saved as PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def pyplot() -> Any | None:
    """``matplotlib.pyplot`` on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: PLC0415 - optional, only when a suite draws

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return None
    return plt


def save(fig: Any, path: Path, *, dpi: int = 110) -> Path:
    """Write ``fig`` to ``path`` (folders created) and free it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    import matplotlib.pyplot as plt  # noqa: PLC0415 - save() follows a successful pyplot()

    plt.close(fig)
    return path

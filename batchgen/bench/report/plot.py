"""The bench report's timeline as a figure: running batch size and output tokens/s over time."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def check_plot_format(path: str | Path) -> None:
    """Check that matplotlib can write `path`'s format (its suffix: png, pdf, svg, ...); call
    `require_matplotlib` first.

    Raises:
        ValueError: no suffix, or one matplotlib cannot write; the message lists the formats.
    """
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in formats:
        given = f"'.{suffix}'" if suffix else "no suffix"
        raise ValueError(
            f"--plot {path} has {given}; name a file ending in .png (or one of: "
            f"{', '.join('.' + f for f in sorted(formats))})"
        )


def require_matplotlib() -> Any:
    """`matplotlib.pyplot` with the non-interactive Agg backend (the `plot` extra).

    Raises:
        RuntimeError: when matplotlib is not installed, saying how to install it.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install 'batchgen[plot]' (or matplotlib)") from exc
    return plt


def plot(report: dict[str, Any], path: str | Path, bin_s: float | None = None) -> None:
    """PNG: running batch size (top) and output tokens/s (bottom) over time, one line per configuration.

    Tokens/s is binned in `bin_s`-second bins (default: the longest wall time / 60).

    Raises:
        RuntimeError: when matplotlib is not installed (`pip install 'batchgen[plot]'`).
    """
    plt = require_matplotlib()
    import numpy as np

    ok = [c for c in report["configurations"] if c["status"] == "ok" and c["timeline"]["t"]]
    longest = max((c["metrics"]["wall_s"] or 0.0 for c in ok), default=1.0) or 1.0
    bin_s = bin_s or max(longest / 60.0, 1e-3)
    fig, (ax_b, ax_t) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for c in ok:
        tl = c["timeline"]
        t = np.asarray(tl["t"])
        ax_b.step(t, tl["num_seqs"], where="pre", label=c["name"], linewidth=1.2)
        edges = np.arange(0.0, t.max() + bin_s, bin_s)
        counts, _ = np.histogram(t, bins=edges, weights=np.asarray(tl["num_generation_tokens"], dtype=float))
        ax_t.step(edges[1:], counts / bin_s, where="pre", label=c["name"], linewidth=1.2)
    ax_b.set_ylabel("running batch size (sequences)")
    ax_t.set_ylabel(f"output tokens/s ({bin_s:.2g} s bins)")
    ax_t.set_xlabel("time since start (s)")
    w = report["workload"]
    fig.suptitle(f"batchgen bench: {w['name']}, {w['num_requests']} requests, {report['model']['dtype']}")
    ax_b.legend(loc="upper right", fontsize="small")
    ax_b.grid(alpha=0.3)
    ax_t.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)

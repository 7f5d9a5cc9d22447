"""Pictures: a run's epsilon and loss versus step; the privacy-utility frontier across runs."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # headless: files and notebooks, never a window
import matplotlib.pyplot as plt  # noqa: E402


def training_curves(history):
    """Epsilon (left axis) and training loss (right axis) against the logical step."""
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    if any(e == e for e in history.epsilon):  # any non-NaN: a private run
        ax.plot(history.steps, history.epsilon, color="tab:blue", label="epsilon")
        ax.set_ylabel("epsilon", color="tab:blue")
    ax.set_xlabel("step")
    twin = ax.twinx()
    twin.plot(history.steps, history.loss, color="tab:orange", label="loss")
    twin.set_ylabel("training loss", color="tab:orange")
    ax.set_title("privacy spent and training loss")
    fig.tight_layout()
    plt.close(fig)
    return fig

"""Pictures: a run's epsilon and loss versus step; what its epsilon means (the membership-inference trade-off curve);
the privacy-utility frontier across runs."""

from __future__ import annotations

from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")  # headless: files and notebooks, never a window
import matplotlib.pyplot as plt  # noqa: E402


def training_curves(history):
    """What a run logged against the logical step: for a private run epsilon (left axis, one marker per logged line,
    delta in its label) and the training loss (right axis) when it was published; for a non-private run the loss alone. ``history`` has
    ``steps``, ``loss``, ``epsilon`` (empty or all NaN: non-private) and optionally ``delta``. Nothing is drawn that was
    not logged: a line logged without epsilon (runs from before every line had one) leaves a gap, not a straight line."""
    epsilon = list(history.epsilon)
    private = any(e == e for e in epsilon)  # NaN != NaN
    has_loss = any(v == v for v in history.loss)  # a private run publishes its loss only when asked
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    ax.set_xlabel("step")
    delta = getattr(history, "delta", None)
    unit = " per user" if getattr(history, "unit", "example") == "user" else ""  # privacy.unit=user
    label = f"epsilon{unit}" + (f" (delta = {delta:.1e})" if delta is not None else "")
    if private and not has_loss:
        ax.plot(history.steps, epsilon, color="tab:blue", marker=".", label=label)
        ax.set_ylabel(label, color="tab:blue")
        ax.set_title("privacy spent (training loss not published: not covered by epsilon)", fontsize=9)
        ax.legend(loc="lower right", fontsize=8)
    elif not private:
        ax.plot(history.steps, history.loss, color="tab:orange", marker=".", label="training loss")
        ax.set_ylabel("training loss")
        ax.set_title("training loss (non-private run: no privacy spent)")
        ax.legend(loc="upper right", fontsize=8)
    else:
        ax.plot(history.steps, epsilon, color="tab:blue", marker=".", label=label)
        ax.set_ylabel(label, color="tab:blue")
        twin = ax.twinx()
        twin.plot(history.steps, history.loss, color="tab:orange", marker=".", label="training loss")
        twin.set_ylabel("training loss", color="tab:orange")
        ax.set_title("privacy spent and training loss")
        ax.legend(handles=ax.lines + twin.lines, loc="center right", fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


def privacy_tradeoff(fpr, tpr, epsilon: float, delta: float, advantage: float, unit: str = "example"):
    """What a run's epsilon means: the most TPR any membership-inference attack can reach at each FPR (an upper bound,
    workbench/privacy/accounting/tradeoff.py), log-log, against guessing (TPR = FPR); the reported FPRs marked."""
    points = [(a, t) for a, t in zip(fpr, tpr) if a > 0]
    fig, ax = plt.subplots(figsize=(5, 4.2), dpi=110)
    ax.plot([a for a, _ in points], [t for _, t in points], color="tab:red",
            label=f"most any attack achieves (advantage <= {advantage:.3f})")
    ax.plot([points[0][0], 1], [points[0][0], 1], color="tab:gray", linestyle="--", label="guessing (TPR = FPR)")
    for a, t in points:
        if a in (1e-3, 1e-2):
            ax.plot(a, t, "o", color="tab:red")
            ax.annotate(f"TPR <= {t:.3g}", (a, t), textcoords="offset points", xytext=(6, -10), fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("false-positive rate (non-members called members)")
    ax.set_ylabel("true-positive rate (members found)")
    who = "user" if unit == "user" else "membership"  # privacy.unit=user: the attack asks whether a user took part
    ax.set_title(f"{who} inference: the bound at epsilon = {epsilon:.3g}, delta = {delta:.1e}"
                 + (" per user" if unit == "user" else ""), fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


def _labelled(text: str, runs, column: str, name: str) -> str:
    """`text (name=value)` when every run in `runs` has the same value in `column`."""
    if column in runs and runs[column].nunique(dropna=False) == 1:
        return f"{text} ({name}={runs[column].iloc[0]})"
    return text


def frontier(runs, metric: str = "eval_accuracy", title: str | None = None):
    """The privacy-utility frontier: `metric` against the final epsilon of each private run (a table such as
    :func:`workbench.explore.runs_frame` returns: columns `epsilon`, `metric`, optionally `delta` and `params.*`).
    Non-private runs (no epsilon) are drawn as horizontal lines: the utility that privacy is paid in."""
    if metric not in runs:
        raise ValueError(f"no column {metric!r} in the runs table (columns: {', '.join(map(str, runs.columns))})")
    runs = runs[runs[metric].notna()]
    eps = runs["epsilon"] if "epsilon" in runs else runs[metric] * float("nan")
    private, baselines = runs[eps.notna()].sort_values("epsilon"), runs[eps.isna()]
    fig, ax = plt.subplots(figsize=(6.4, 4), dpi=110)
    if len(private):
        label = _labelled("DP-SGD", private, "params.learning_rate", "lr")
        ax.plot(private["epsilon"], private[metric], marker="o", color="tab:blue", label=label)
        for x, y in zip(private["epsilon"], private[metric]):
            ax.annotate(f"{y:.3f}", (x, y), textcoords="offset points", xytext=(0, -9), ha="center", va="top",
                        fontsize=8)  # below: a baseline line usually runs above the points
        ax.set_xscale("log")
        ticks = sorted(set(round(float(e), 2) for e in private["epsilon"]))
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
    for i, (_, row) in enumerate(baselines.iterrows()):
        label = _labelled("non-private baseline", baselines.loc[[row.name]], "params.learning_rate", "lr")
        ax.axhline(row[metric], color="tab:gray", linestyle="--" if i == 0 else ":", label=f"{label}: {row[metric]:.3f}")
    delta = private["delta"].dropna().unique() if "delta" in private else []
    ax.set_xlabel("epsilon" + (f" (delta = {delta[0]:.1e})" if len(delta) == 1 else ""))
    ax.set_ylabel(metric)
    if title is None:
        title = f"privacy-utility frontier: {metric} vs epsilon"
        what = [str(runs[c].iloc[0]).rsplit(".", 1)[-1] for c in ("params.data.train._target_", "params.model._target_")
                if c in runs and runs[c].nunique() == 1]
        title += f"\n{' + '.join(what)}" if what else ""
    ax.set_title(title, fontsize=11)
    ax.margins(y=0.15)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig


# What the tracking worker may draw from a run's JSON data (tracker.log_plot): figure name -> drawing function.
FIGURES = {"training_curves": lambda **history: training_curves(SimpleNamespace(**history)),
           "privacy_tradeoff": privacy_tradeoff}

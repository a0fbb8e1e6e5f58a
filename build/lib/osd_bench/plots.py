"""Moving-average alpha curves vs requests (the paper's figures), shared by both replay modes; a resource series
over time (the soak's server RSS); grouped bars (the learning evidence across replays)."""
from __future__ import annotations


def moving_average(values: list[float | None], window: int) -> list[float]:
    """Trailing mean over the last `window` values; None (no measurement, e.g. no proposals) is left out of the
    mean, and a window with no values gives NaN (a gap in the curve)."""
    out, acc = [], []
    for v in values:
        acc.append(v)
        if len(acc) > window:
            acc.pop(0)
        present = [a for a in acc if a is not None]
        out.append(sum(present) / len(present) if present else float("nan"))
    return out


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or None where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save(plt, fig, path: str, dpi: int) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_alpha_curves(curves: dict[str, list[float]], boundaries: list[int], title: str, ylabel: str, path: str,
                      window: int, x: list[int] | None = None) -> str | None:
    """One line per curve (moving average), dotted lines at segment boundaries; None without matplotlib.
    x: the request index of each value (default 0, 1, ...), for curves measured on some requests only."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for label, values in curves.items():
        ax.plot(x if x is not None else range(len(values)), moving_average(values, window), label=label)
    for i in boundaries:
        ax.axvline(i, color="grey", linestyle=":")
    ax.set_xlabel("request")
    ax.set_ylabel(f"{ylabel} (moving average, {window})")
    ax.set_title(title)
    ax.legend()
    return _save(plt, fig, path, dpi=120)


def plot_alpha_panels(panels: dict[str, dict[str, list[float]]], title: str, ylabel: str, path: str,
                      window: int) -> str | None:
    """One panel per title (e.g. per topic), one line per curve (moving average over that panel's own requests);
    None without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), sharey=True, squeeze=False)
    for ax, (name, curves) in zip(axes[0], panels.items()):
        for label, values in curves.items():
            ax.plot(moving_average(values, window), label=label)
        ax.set_title(name)
        ax.set_xlabel(f"request of {name}")
    axes[0][0].set_ylabel(f"{ylabel} (moving average, {window})")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title)
    return _save(plt, fig, path, dpi=110)


def plot_grouped_bars(groups: list[str], series: dict[str, list[float | None]], title: str, ylabel: str,
                      path: str) -> str | None:
    """One group of bars per label in `groups`, one bar per series (a missing value draws no bar); None without
    matplotlib or groups."""
    plt = _pyplot()
    if plt is None or not groups:
        return None
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(groups)), 4.2))
    width = 0.8 / len(series)
    for j, (label, values) in enumerate(series.items()):
        offset = (j - (len(series) - 1) / 2) * width
        ax.bar([i + offset for i in range(len(groups))], [v or 0.0 for v in values], width, label=label)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    return _save(plt, fig, path, dpi=120)


def domain_boundaries(rows: list[dict]) -> list[int]:
    return [i for i in range(1, len(rows)) if rows[i]["domain"] != rows[i - 1]["domain"]]


def plot_series(values: list[float], every: float, title: str, ylabel: str, path: str,
                marks: dict[str, float] | None = None) -> str | None:
    """One sampled series against time (sample i at i * every seconds); `marks` draws labelled horizontal lines
    (e.g. the medians of each half); None without matplotlib."""
    plt = _pyplot()
    if plt is None or not values:
        return None
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot([i * every for i in range(len(values))], values, label=ylabel)
    for (label, y), style in zip((marks or {}).items(), ("--", ":", "-.")):
        ax.axhline(y, color="grey", linestyle=style, label=label)
    ax.set_xlabel("seconds since the warm-up")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    return _save(plt, fig, path, dpi=120)

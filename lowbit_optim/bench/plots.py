"""The benchmark's two pictures: validation-loss curves, and memory per optimizer."""

import pathlib

import matplotlib

matplotlib.use("Agg")  # files only; works without a display
import matplotlib.pyplot as plt  # noqa: E402


def loss_curves(runs: dict[str, list[dict]], path: pathlib.Path, title: str) -> None:
    """Validation (solid) and train (dashed) loss against step, one colour per optimizer;
    with several seeds, the mean curve and a band from the lowest to the highest seed."""
    fig, ax = plt.subplots(figsize=(8, 5))
    for color_index, (label, seeds) in enumerate(runs.items()):
        color = f"C{color_index}"
        steps = seeds[0]["curve"]["step"]
        for split, style in (("val_loss", "-"), ("train_loss", "--")):
            per_seed = [run["curve"][split] for run in seeds]
            mean = [sum(values) / len(values) for values in zip(*per_seed)]
            ax.plot(steps, mean, style, color=color,
                    label=f"{label} ({'val' if split == 'val_loss' else 'train'})")
            if len(seeds) > 1:
                low = [min(values) for values in zip(*per_seed)]
                high = [max(values) for values in zip(*per_seed)]
                ax.fill_between(steps, low, high, color=color, alpha=0.15, linewidth=0)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def memory_bars(rows: list[dict], path: pathlib.Path, title: str) -> None:
    """Two panels: optimizer-state bytes per parameter, and peak training memory (MiB)."""
    labels = [row["label"] for row in rows]
    fig, (state_ax, peak_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    colors = [f"C{i}" for i in range(len(rows))]
    state = [row["state_bytes_per_param"] for row in rows]
    bars = state_ax.barh(labels, state, color=colors)
    state_ax.bar_label(bars, fmt="%.2f", padding=2)
    state_ax.margins(x=0.15)
    state_ax.set_xlabel("optimizer state, bytes per parameter")
    state_ax.invert_yaxis()
    peak = [row["peak_memory_bytes"] / 2**20 for row in rows]
    bars = peak_ax.barh(labels, peak, color=colors)
    peak_ax.bar_label(bars, fmt="%.1f", padding=2)
    peak_ax.margins(x=0.15)
    peak_ax.set_xlabel("peak tensor memory during a training step, MiB")
    peak_ax.invert_yaxis()
    peak_ax.set_yticklabels([])
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

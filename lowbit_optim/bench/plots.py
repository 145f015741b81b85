"""The benchmark's two pictures: validation-loss curves, and memory per optimizer."""

import pathlib

import matplotlib

matplotlib.use("Agg")  # files only; works without a display
import matplotlib.pyplot as plt  # noqa: E402

# Two curves closer than this fraction of the axis' loss range at every point look like one
# line (about one line width on the 5-inch figure): the legend says which one lies underneath.
COINCIDE_FRACTION = 0.01
MARKERS = "osD^vP*X"


def coinciding(curves: dict[str, list[float]], tolerance: float) -> dict[str, list[str]]:
    """label -> the labels drawn before it whose curve is within ``tolerance`` of its own at
    every point (so the later one hides them)."""
    labels = list(curves)
    return {
        label: [earlier for earlier in labels[:index]
                if all(abs(a - b) <= tolerance for a, b in zip(curves[earlier], curves[label], strict=True))]
        for index, label in enumerate(labels)
    }


def loss_curves(runs: dict[str, list[dict]], path: pathlib.Path, title: str) -> list[str]:
    """Validation (solid, with markers) and train (dashed) loss against step, one colour and
    marker per optimizer; with several seeds, the mean curve and a band from the lowest to the
    highest seed. Markers are staggered so that each optimizer's stay visible where curves
    overlap, and a curve drawn over another that it matches says so in the legend. Returns
    the legend's labels."""
    fig, ax = plt.subplots(figsize=(8, 5))
    means = {}
    for label, seeds in runs.items():
        for split in ("val_loss", "train_loss"):
            per_seed = [run["curve"][split] for run in seeds]
            means[label, split] = [sum(values) / len(values) for values in zip(*per_seed)]
    values = [value for curve in means.values() for value in curve]
    tolerance = COINCIDE_FRACTION * (max(values) - min(values)) if values else 0.0
    legend = []
    for split, style in (("val_loss", "-"), ("train_loss", "--")):
        hidden = coinciding({label: means[label, split] for label in runs}, tolerance)
        for index, (label, seeds) in enumerate(runs.items()):
            color, steps = f"C{index}", seeds[0]["curve"]["step"]
            text = f"{label} ({'val' if split == 'val_loss' else 'train'})"
            if hidden[label]:
                text += f", over {' and '.join(hidden[label])}: same curve"
            marker = dict(marker=MARKERS[index % len(MARKERS)], markevery=(index, len(runs)),
                          markersize=5) if split == "val_loss" else {}
            ax.plot(steps, means[label, split], style, color=color, label=text, **marker)
            legend.append(text)
            if len(seeds) > 1:
                per_seed = [run["curve"][split] for run in seeds]
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
    return legend


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


def front_page(rows: list[dict], path: pathlib.Path, machine: str) -> None:
    """The README's picture: state bytes per parameter and training-step time per optimizer,
    each bar labelled with the final validation loss's gap to fp32 AdamW."""
    labels = [row["label"] for row in rows]
    colors = ["C0" if row["optimizer"].startswith("lowbit_") else "C7" for row in rows]
    fig, (state_ax, time_ax) = plt.subplots(1, 2, figsize=(10, 3.2))
    bars = state_ax.barh(labels, [row["state_bytes_per_param"] for row in rows], color=colors)
    state_ax.bar_label(bars, fmt="%.2f", padding=2)
    state_ax.set_xlabel("optimizer state, bytes per parameter")
    state_ax.invert_yaxis()
    bars = time_ax.barh(labels, [row["train_step_ms"] for row in rows], color=colors)
    gaps = [f"{row['train_step_ms']:.0f} ms, loss {row['val_gap_pct']:+.1f}%"
            if row.get("val_gap_pct") is not None else f"{row['train_step_ms']:.0f} ms" for row in rows]
    time_ax.bar_label(bars, labels=gaps, padding=2, fontsize=8)
    time_ax.set_xlabel("training step, ms (loss: final validation loss vs fp32 AdamW)")
    time_ax.invert_yaxis()
    time_ax.set_yticklabels([])
    for ax in (state_ax, time_ax):
        ax.margins(x=0.35)
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(machine, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

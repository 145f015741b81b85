"""What ``python -m lowbit_optim.bench`` reports: one row per optimizer (means over seeds, gaps
to fp32 AdamW paired by seed), the full markdown table (``table.md``), the narrow table printed
while it runs, and the front page's table."""

import statistics
from dataclasses import dataclass

from lowbit_optim.bench import harness

BASELINE = "torch_adamw"
# The terminal table must fit this many characters (a default 100-column terminal); table.md
# and results.json keep every column.
TERMINAL_WIDTH = 100


def _mean(values: list) -> float | None:
    present = [value for value in values if value is not None]
    return statistics.mean(present) if present else None


def _spread(values: list[float]) -> float | None:
    return statistics.stdev(values) if len(values) > 1 else None


def _gaps(seeds: list[dict], reference: dict[int, dict]) -> list[float]:
    """Validation-loss gaps in percent to ``reference`` (runs by seed), for the seeds both have
    evaluated at the same step (a run stopped part way has its last evaluation's losses)."""
    gaps = []
    for run in seeds:
        other = reference.get(run["seed"])
        if (other is not None and run["final_val_loss"] is not None
                and other["loss_step"] == run["loss_step"]):
            gaps.append(100 * (run["final_val_loss"] / other["final_val_loss"] - 1))
    return gaps


def summarize(runs: dict[str, list[dict]]) -> list[dict]:
    """One row per optimizer: means over seeds, the seed spread, and the gap to fp32 paired
    by seed (same weights and batches), so seed noise common to both cancels. A run stopped
    part way (``complete`` False) is labelled with the step it reached."""
    baseline = {run["seed"]: run for run in runs.get(BASELINE, [])}
    rows = []
    for seeds in runs.values():
        first = seeds[0]
        val = [run["final_val_loss"] for run in seeds if run["final_val_loss"] is not None]
        peaks = [run["peak_memory_bytes"] for run in seeds if run["peak_memory_bytes"] is not None]
        complete = all(run["complete"] for run in seeds)
        row = {key: first[key] for key in ("optimizer", "label", "params", "state_bytes",
                                           "state_bytes_per_param")}
        if not complete:
            steps = min(run["steps_done"] for run in seeds)
            row["label"] += f" (stopped after {steps} steps)"
        row.update(
            seeds=[run["seed"] for run in seeds],
            complete=complete,
            training_bytes_per_param=first.get("training_bytes_per_param"),
            peak_memory_bytes=max(peaks) if peaks else None,
            peak_memory_mib=max(peaks) / 2**20 if peaks else None,
            first_step_s=first["first_step_s"],  # later seeds reuse the compiled graphs
            step_ms=statistics.median(run["step_ms"] for run in seeds),
            train_step_ms=statistics.median(run["train_step_ms"] for run in seeds),
            recompiles_after_first_step=sum(run["recompiles_after_first_step"] for run in seeds),
            final_train_loss=_mean([run["final_train_loss"] for run in seeds]),
            final_val_loss=_mean(val),
            val_loss_sd=_spread(val),
            # Each seed's own, in the order of ``seeds``: runs made apart (another optimizer
            # later, fp32 on another day) can still be paired by seed.
            final_val_loss_per_seed=[run["final_val_loss"] for run in seeds],
        )
        reference_name = harness.OPTIMIZERS[first["optimizer"]].reference
        reference = {run["seed"]: run for run in runs.get(reference_name, [])}
        gaps = _gaps(seeds, reference)
        if gaps:
            row["val_gap_vs_reference_pct"] = statistics.mean(gaps)
            row["val_gap_vs_reference_pct_sd"] = _spread(gaps)
        if baseline:
            base = baseline.get(first["seed"], next(iter(baseline.values())))
            row["state_saving"] = base["state_bytes"] / max(first["state_bytes"], 1)
            row["train_step_ratio"] = row["train_step_ms"] / statistics.median(
                run["train_step_ms"] for run in baseline.values())
            gaps = _gaps(seeds, baseline)
            if gaps:
                row["val_gap_pct"] = statistics.mean(gaps)
                row["val_gap_pct_sd"] = _spread(gaps)
        rows.append(row)
    return rows


def table_columns(multi_seed: bool, references: bool = False) -> list[harness.Column]:
    """Every column, for table.md."""
    columns = [
        harness.Column("optimizer", "label"),
        harness.Column("state B/param", "state_bytes_per_param", "{:.2f}"),
        harness.Column("training B/param", "training_bytes_per_param", "{:.2f}"),
        harness.Column("saving vs fp32", "state_saving", "{:.2f}x"),
        harness.Column("peak MiB", "peak_memory_mib", "{:.1f}"),
        harness.Column("opt step ms", "step_ms", "{:.1f}"),
        harness.Column("train step ms", "train_step_ms", "{:.1f}"),
        harness.Column("first step s", "first_step_s", "{:.2f}"),
        harness.Column("recompiles", "recompiles_after_first_step"),
        harness.Column("train loss", "final_train_loss", "{:.4f}"),
        harness.Column("val loss", "final_val_loss", "{:.4f}"),
    ]
    if multi_seed:
        columns.append(harness.Column("val sd", "val_loss_sd", "{:.4f}"))
    columns.append(harness.Column("val gap vs fp32", "val_gap_pct", "{:+.2f}%"))
    if multi_seed:
        columns.append(harness.Column("gap sd", "val_gap_pct_sd", "{:.2f}"))
    if references:
        columns.append(harness.Column("gap vs its reference", "val_gap_vs_reference_pct", "{:+.2f}%"))
        if multi_seed:
            columns.append(harness.Column("ref gap sd", "val_gap_vs_reference_pct_sd", "{:.2f}"))
    return columns


@dataclass(frozen=True)
class GapColumn(harness.Column):
    """A gap in percent, with its spread over seeds where there are several (``+0.52±0.31``)."""

    sd_key: str = ""

    def render(self, row: dict) -> str:
        value, spread = row.get(self.key), row.get(self.sd_key)
        if value is None:
            return "-"
        return f"{value:+.2f}" + (f"±{spread:.2f}" if spread is not None else "")


LEGEND = ("B/param: optimizer state bytes per parameter; step ms, train ms: median optimizer step and "
          "training step (forward, backward, step);\nfirst s: the first step (compiles); % vs fp32: "
          "validation loss against fp32 AdamW's, same seed; % vs ref: against the row's reference.")


@dataclass(frozen=True)
class TerminalTable:
    """The columns a reader compares first, aligned, printed a row at a time as runs finish."""

    columns: tuple[harness.Column, ...]
    widths: tuple[int, ...]

    @classmethod
    def for_run(cls, names: list[str], references: bool) -> "TerminalTable":
        columns = [harness.Column("optimizer", "optimizer"),
                   harness.Column("B/param", "state_bytes_per_param", "{:.2f}"),
                   harness.Column("step ms", "step_ms", "{:.1f}"),
                   harness.Column("train ms", "train_step_ms", "{:.1f}"),
                   harness.Column("first s", "first_step_s", "{:.2f}"),
                   harness.Column("val loss", "final_val_loss", "{:.4f}"),
                   GapColumn("% vs fp32", "val_gap_pct", sd_key="val_gap_pct_sd")]
        if references:
            columns.append(GapColumn("% vs ref", "val_gap_vs_reference_pct",
                                     sd_key="val_gap_vs_reference_pct_sd"))
        # A gap with its spread ("+0.52±0.31") is the widest value a numeric column holds.
        widths = [max(len(name) for name in [*names, "optimizer"])]
        widths += [max(len(column.header), 10 if isinstance(column, GapColumn) else 7)
                   for column in columns[1:]]
        return cls(tuple(columns), tuple(widths))

    def _line(self, cells: list[str]) -> str:
        first, *rest = cells
        return "  ".join([first.ljust(self.widths[0]),
                          *(cell.rjust(width) for cell, width in zip(rest, self.widths[1:]))]).rstrip()

    def header(self) -> str:
        return self._line([column.header for column in self.columns])

    def line(self, row: dict) -> str:
        return self._line([column.render(row) for column in self.columns])

    def render(self, rows: list[dict]) -> str:
        return "\n".join([self.header(), *(self.line(row) for row in rows)])


# The front page's comparison: fp32 AdamW, ours, torchao's and bitsandbytes' low-bit AdamW.
FRONT_PAGE_OPTIMIZERS = ("torch_adamw", "lowbit_8bit", "lowbit_4bit", "torchao_8bit", "torchao_4bit",
                         "bnb_8bit")
FRONT_PAGE_COLUMNS = [
    harness.Column("optimizer", "label"),
    harness.Column("state bytes/param", "state_bytes_per_param", "{:.2f}"),
    harness.Column("train step, x fp32", "train_step_ratio", "{:.2f}x"),
    harness.Column("final val loss", "final_val_loss", "{:.3f}"),
    harness.Column("vs fp32", "val_gap_pct", "{:+.1f}%"),
]

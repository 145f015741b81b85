"""``python -m lowbit_optim.bench`` (or ``lowbit-optim-bench``): low-bit AdamW against fp32
AdamW on a real training run — memory, speed and loss in one table, JSON and two plots.

A small GPT-style byte-level model trains on the standard library's own sources with each
optimizer: same initial weights, same batches in the same order, same warmup+cosine
schedule (``LambdaLR``). See ``docs/benchmarks.md`` for what every column measures.
"""

import argparse
import dataclasses
import pathlib
import statistics
import sys
import time

import torch

from lowbit_optim.bench import harness
from lowbit_optim.bench.data import load_corpus
from lowbit_optim.bench.model import ModelConfig
from lowbit_optim.bench.train import TrainConfig, train

BASELINE = "torch_adamw"
DEFAULT_OPTIMIZERS = ("torch_adamw", "lowbit_8bit", "lowbit_4bit")
# ``--optimizers all``: the default set, our float8 optimizer and every peer that is
# installed. Peers are not in the default run because torchao compiles one graph per
# parameter shape (~25-30 s of first step each here) and steps 2-5x slower than ours, which
# does not fit the default run's budget.
ALL_OPTIMIZERS = DEFAULT_OPTIMIZERS + ("lowbit_fp8",) + harness.PEERS

# Each preset: the model and the training run that suits it. "small" is the default: on an
# idle 2-core Xeon it took 3 minutes for the three default optimizers on a fresh clone with
# empty compile and extension caches (the C++ CPU step built in ~15 s; README.md says so). Its
# 500 steps take the model well past the ~3.1-nat unigram plateau (to ~1.93 nats), where the
# gap to fp32 AdamW on the same seed varies by under 0.5 points between seeds, so a 3-seed mean
# resolves a 1% difference (measured in docs/benchmarks.md).
# Every preset clips the gradient norm to 1.0 (the GPT recipe): without it, the 300-step
# runs tried that way drifted apart by 3-8% between optimizers on the same seed.
PRESETS = {
    "quick": dict(model=ModelConfig(d_model=64, n_layers=2, n_heads=2, context=64),
                  steps=30, batch_size=8, lr=3e-3, eval_every=15, eval_batches=2),
    "small": dict(model=ModelConfig(d_model=128, n_layers=4, n_heads=4, context=128),
                  steps=500, batch_size=16, lr=3e-3, eval_every=50, eval_batches=8),
    "medium": dict(model=ModelConfig(d_model=256, n_layers=6, n_heads=8, context=256),
                   steps=1000, batch_size=16, lr=2e-3, eval_every=50, eval_batches=16),
    # ~114M parameters: for a GPU.
    "gpu-114m": dict(model=ModelConfig(d_model=768, n_layers=16, n_heads=12, context=512),
                     steps=2000, batch_size=32, lr=6e-4, eval_every=100, eval_batches=20),
}
GRAD_CLIP = 1.0


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="lowbit-optim-bench",
        description="Train a small byte-level GPT with fp32 AdamW and low-bit AdamW; "
                    "print memory, speed and loss side by side.",
    )
    parser.add_argument("--model-size", choices=sorted(PRESETS), default="small",
                        help="model and run preset (default: small; gpu-114m wants a GPU)")
    parser.add_argument("--steps", type=int, help="training steps (default: the preset's)")
    parser.add_argument("--optimizers", nargs="+", default=list(DEFAULT_OPTIMIZERS),
                        help=f"names from {sorted(harness.OPTIMIZERS)}, or 'peers', 'rules' (Lion and "
                             "AdEMAMix, ours and bitsandbytes'), 'precision' (bf16 weights: "
                             "rounding, stochastic rounding, 24/32-bit master weights) or 'all' "
                             f"(default: {' '.join(DEFAULT_OPTIMIZERS)}); peers that are not "
                             "installed are skipped")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the model's parameter dtype, for the rows that do not fix their own "
                             "(the *_bf16, *_bf16_sr, *_mw24 and *_mw32 rows train in bfloat16)")
    parser.add_argument("--lr", type=float, help="peak learning rate (default: the preset's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data order")
    parser.add_argument("--seeds", type=int, nargs="+",
                        help="several seeds: report means and the seed spread (overrides --seed)")
    parser.add_argument("--batch-size", type=int,
                        help="sequences per step (default: the preset's); e.g. 1 to measure the "
                             "gpu-114m model's memory on a CPU")
    parser.add_argument("--grad-clip", type=float, default=GRAD_CLIP, metavar="NORM",
                        help=f"clip the gradient norm to NORM before each step; 0 turns clipping "
                             f"off (default: {GRAD_CLIP})")
    parser.add_argument("--release-gradients", action="store_true",
                        help="step each parameter during backward and free its gradient "
                             "(lowbit_optim.release_gradients; our optimizers only, with --grad-clip 0)")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute each block's activations in backward (torch.utils.checkpoint), "
                             "so the gradients, not the activations, set the peak")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench_out"),
                        help="where results.json, table.md and the PNGs go (default: bench_out/)")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny smoke run (< 30 s): --model-size quick")
    args = parser.parse_args(argv)
    if args.quick:
        args.model_size = "quick"
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.lr is not None and not args.lr > 0:  # also refuses nan
        parser.error(f"--lr must be > 0, got {args.lr}")
    if args.batch_size is not None and args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if not args.grad_clip >= 0:  # also refuses nan
        parser.error(f"--grad-clip must be >= 0, got {args.grad_clip}")
    if args.release_gradients and args.grad_clip:
        parser.error("--release-gradients frees each gradient during backward, so there is no global "
                     "norm to clip: add --grad-clip 0")
    return args


def summarize(runs: dict[str, list[dict]]) -> list[dict]:
    """One row per optimizer: means over seeds, the seed spread, and the gap to fp32 paired
    by seed (same weights and batches), so seed noise common to both cancels."""
    baseline = {run["seed"]: run for run in runs.get(BASELINE, [])}
    rows = []
    for seeds in runs.values():
        first = seeds[0]
        val = [run["final_val_loss"] for run in seeds]
        row = {key: first[key] for key in ("optimizer", "label", "params", "state_bytes",
                                           "state_bytes_per_param")}
        row.update(
            seeds=[run["seed"] for run in seeds],
            training_bytes_per_param=first.get("training_bytes_per_param"),
            peak_memory_bytes=max(run["peak_memory_bytes"] for run in seeds),
            peak_memory_mib=max(run["peak_memory_bytes"] for run in seeds) / 2**20,
            first_step_s=first["first_step_s"],  # later seeds reuse the compiled graphs
            step_ms=statistics.median(run["step_ms"] for run in seeds),
            train_step_ms=statistics.median(run["train_step_ms"] for run in seeds),
            recompiles_after_first_step=sum(run["recompiles_after_first_step"] for run in seeds),
            final_train_loss=statistics.mean(run["final_train_loss"] for run in seeds),
            final_val_loss=statistics.mean(val),
            val_loss_sd=statistics.stdev(val) if len(val) > 1 else None,
            # Each seed's own, in the order of ``seeds``: runs made apart (another optimizer
            # later, fp32 on another day) can still be paired by seed.
            final_val_loss_per_seed=val,
        )
        reference_name = harness.OPTIMIZERS[first["optimizer"]].reference
        reference = {run["seed"]: run for run in runs.get(reference_name, [])}
        if reference:
            gaps = [100 * (run["final_val_loss"] / reference[run["seed"]]["final_val_loss"] - 1)
                    for run in seeds if run["seed"] in reference]
            row["val_gap_vs_reference_pct"] = statistics.mean(gaps)
            row["val_gap_vs_reference_pct_sd"] = statistics.stdev(gaps) if len(gaps) > 1 else None
        if baseline:
            base = baseline[first["seed"]]
            row["state_saving"] = base["state_bytes"] / max(first["state_bytes"], 1)
            gaps = [100 * (run["final_val_loss"] / baseline[run["seed"]]["final_val_loss"] - 1)
                    for run in seeds if run["seed"] in baseline]
            row["val_gap_pct"] = statistics.mean(gaps)
            row["val_gap_pct_sd"] = statistics.stdev(gaps) if len(gaps) > 1 else None
        rows.append(row)
    return rows


def table_columns(multi_seed: bool, references: bool = False) -> list[harness.Column]:
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


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was asked for, but torch sees no CUDA device")
    names, skipped = harness.resolve_optimizers(args.optimizers, all_names=ALL_OPTIMIZERS)
    if skipped:
        print(f"skipped (not installed): {', '.join(skipped)}", file=sys.stderr)
    if not names:
        raise SystemExit("no optimizer to run")
    preset = dict(PRESETS[args.model_size])
    if args.steps is not None:
        preset["steps"] = args.steps
    if args.batch_size is not None:
        preset["batch_size"] = args.batch_size
    if args.lr is not None:
        preset["lr"] = args.lr
    if args.activation_checkpointing:
        preset["model"] = dataclasses.replace(preset["model"], activation_checkpointing=True)
    steps = preset["steps"]
    preset["eval_every"] = min(preset["eval_every"], steps)
    seeds = args.seeds or [args.seed]
    corpus = load_corpus()

    def config_for(seed: int) -> TrainConfig:
        return TrainConfig(weight_decay=0.1, betas=(0.9, 0.95), warmup_steps=max(1, steps // 10),
                           min_lr_ratio=0.1, grad_clip=args.grad_clip or None, seed=seed,
                           param_dtype=args.param_dtype, release_gradients=args.release_gradients,
                           **preset)

    from tqdm.auto import tqdm

    env = harness.environment(device)
    machine = harness.machine_line(env)
    args.out.mkdir(parents=True, exist_ok=True)

    def write_results(runs: dict[str, list[dict]], elapsed: float) -> tuple[str, str, str]:
        """results.json and table.md for the runs finished so far: rewritten after every
        optimizer, so a run stopped part way (Ctrl-C, a time limit) keeps what it measured."""
        finished = {name: seed_runs for name, seed_runs in runs.items() if seed_runs}
        rows = summarize(finished)
        config = {
            "model_size": args.model_size, "model": preset["model"].as_dict(),
            **{k: v for k, v in config_for(seeds[0]).__dict__.items() if k not in ("model", "seed")},
            "seeds": seeds, "optimizers": names, "finished": list(finished), "skipped": skipped,
            "device": str(device), "corpus": corpus.describe(), "wall_s": elapsed,
        }
        all_runs = [run for seed_runs in finished.values() for run in seed_runs]
        harness.write_json(args.out / "results.json", "train", rows, env=env,
                           config={**config, "runs": all_runs})
        table = harness.markdown_table(rows, table_columns(
            len(seeds) > 1, any("val_gap_vs_reference_pct" in row for row in rows)))
        run_line = (f"{args.model_size} preset: {rows[0]['params'] / 1e6:.2f}M params, {steps} "
                    f"steps of {preset['batch_size']} x {preset['model'].context} bytes, seeds {seeds}"
                    f"{', activation checkpointing' if args.activation_checkpointing else ''}"
                    f"{', gradients released' if args.release_gradients else ''}")
        heading = f"{run_line}; {machine}"
        (args.out / "table.md").write_text(f"{heading}\n\n{table}\n")
        return heading, run_line, table

    start = time.perf_counter()
    runs: dict[str, list[dict]] = {name: [] for name in names}
    with tqdm(total=steps * len(names) * len(seeds), desc="training", unit="step",
              mininterval=2.0, file=sys.stderr) as progress:
        for seed in seeds:
            for name in names:
                runs[name].append(train(name, config_for(seed), corpus, device, progress))
                write_results(runs, time.perf_counter() - start)
    elapsed = time.perf_counter() - start
    heading, run_line, table = write_results(runs, elapsed)
    rows = summarize(runs)
    written = ["results.json", "table.md"]
    try:
        from lowbit_optim.bench import plots
    except ImportError as error:  # matplotlib is in the [bench] extra; the table does not need it
        print(f"plots skipped ({error}); pip install matplotlib to draw them", file=sys.stderr)
    else:
        labelled = {harness.OPTIMIZERS[name].label: seed_runs for name, seed_runs in runs.items()}
        plots.loss_curves(labelled, args.out / "loss_curves.png", f"{run_line}\n{machine}")
        plots.memory_bars(rows, args.out / "memory.png", f"{run_line}\n{machine}")
        written += ["loss_curves.png", "memory.png"]
    print(heading)
    print()
    print(table)
    print(f"\n{elapsed:.0f} s; wrote {', '.join(written)} in {args.out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())

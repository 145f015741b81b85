"""``python -m lowbit_optim.bench`` (or ``lowbit-optim-bench``): low-bit AdamW against fp32
AdamW on a real training run — memory, speed and loss in one table, JSON and two plots.

A small GPT-style byte-level model trains on the standard library's own sources with each
optimizer: same initial weights, same batches in the same order, same warmup+cosine
schedule (``LambdaLR``). The optimizers take turns, ``--block-steps`` steps each, after every
one has taken its first step (compilation) and the C++ CPU step has been built or loaded, so
neither background load nor anything of ours lands in one row's timing; each trains exactly
as it would alone (``train.TrainingRun``). Each seed's rows are printed as its runs finish;
results.json and table.md are rewritten after every turn, and Ctrl-C keeps them. See
``docs/benchmarks.md`` for what every column measures.
"""

import argparse
import dataclasses
import json
import pathlib
import sys
import time

import torch

from lowbit_optim.bench import harness
from lowbit_optim.bench.data import load_corpus
from lowbit_optim.bench.model import ModelConfig
from lowbit_optim.bench.report import (
    FRONT_PAGE_COLUMNS,
    FRONT_PAGE_OPTIMIZERS,
    LEGEND,
    TerminalTable,
    summarize,
    table_columns,
)
from lowbit_optim.bench.train import TrainConfig, TrainingRun
from lowbit_optim.step import cpu_kernel

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
# Steps each optimizer takes in its turn: the runs take turns in blocks this long, so a busy
# minute of a shared machine slows every optimizer alike rather than one row.
BLOCK_STEPS = 10
DEFAULT_OUT = pathlib.Path("bench_out")
# What a run writes into its folder (a new run removes them first, so the folder never mixes
# two runs' files).
OUTPUTS = ("results.json", "table.md", "loss_curves.png", "memory.png", "front_page.md", "front_page.png")
# The front page's run: the small preset's model, fewer and smaller steps, so that six
# optimizers (torchao compiling one graph per parameter shape) fit in minutes on a busy 2-core
# machine.
FRONT_PAGE_RUN = dict(steps=50, batch_size=4)
# 128 + SIGINT (2): the shell's exit status for a run stopped by Ctrl-C (SIGINT).
INTERRUPTED = 130


def optimizer_groups() -> dict[str, list[str]]:
    """Every optimizer name, grouped as ``--list-optimizers`` prints them."""
    groups = {"fp32 references": [], "lowbit_optim AdamW": [], "lowbit_optim Lion": [],
              "lowbit_optim AdEMAMix": [], "lowbit_optim Muon": [], "torchao": [], "bitsandbytes": []}
    for name, spec in harness.OPTIMIZERS.items():
        if name.startswith("torch_") or name.endswith("_32bit") or name == "muon":
            groups["fp32 references"].append(name)
        elif spec.package is not None:
            groups[spec.package].append(name)
        else:
            rule = ("Lion" if "_lion_" in name else "AdEMAMix" if "_ademamix_" in name
                    else "Muon" if name.startswith("muon") else "AdamW")
            groups[f"lowbit_optim {rule}"].append(name)
    return groups


def list_optimizers() -> str:
    lines = []
    for group, names in optimizer_groups().items():
        lines.append(f"{group}:")
        width = max(len(name) for name in names)
        for name in names:
            missing = "" if harness.is_available(name) else "  (not installed)"
            lines.append(f"  {name.ljust(width)}  {harness.OPTIMIZERS[name].label}{missing}")
    lines.append("groups: all (the default set, lowbit_fp8 and every installed peer), peers "
                 f"({' '.join(harness.PEERS)}), rules (Lion and AdEMAMix, ours and bitsandbytes'), "
                 "precision (bf16 weights: rounding, stochastic rounding, 24/32-bit master weights)")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lowbit-optim-bench",
        description="Train a small byte-level GPT with fp32 AdamW and low-bit AdamW; "
                    "print memory, speed and loss side by side.",
    )
    parser.add_argument("--model-size", choices=sorted(PRESETS), default="small",
                        help="model and run preset (default: small; gpu-114m wants a GPU)")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny smoke run (< 30 s): --model-size quick")
    parser.add_argument("--front-page", action="store_true",
                        help="the README's comparison: fp32 AdamW, ours, torchao's and bitsandbytes' "
                             f"low-bit AdamW, {FRONT_PAGE_RUN['steps']} steps of "
                             f"{FRONT_PAGE_RUN['batch_size']} sequences on the small model; also writes "
                             "front_page.md and front_page.png")
    parser.add_argument("--steps", type=int, help="training steps (default: the preset's)")
    parser.add_argument("--optimizers", nargs="+", metavar="NAME",
                        help="optimizers or groups to run, see --list-optimizers "
                             f"(default: {' '.join(DEFAULT_OPTIMIZERS)}); peers that are not "
                             "installed are skipped")
    parser.add_argument("--list-optimizers", action="store_true",
                        help="print every optimizer name, grouped, and exit")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the model trains: cpu or cuda (default: cuda when torch sees one)")
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
    parser.add_argument("--block-steps", type=int, default=BLOCK_STEPS, metavar="N",
                        help="the optimizers train in turns of N steps each, so background load "
                             f"slows them alike (default: {BLOCK_STEPS}; as many as --steps: one "
                             "after another)")
    parser.add_argument("--out", type=pathlib.Path,
                        help="where results.json, table.md and the PNGs go (default: "
                             f"{DEFAULT_OUT}/<preset>/, e.g. {DEFAULT_OUT}/small/)")
    parser.add_argument("--overwrite", action="store_true",
                        help="let --out replace another preset's results")
    return parser


def parse_args(argv):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.model_size = "quick"
    args.preset = "front-page" if args.front_page else args.model_size
    if args.optimizers is None:
        args.optimizers = list(FRONT_PAGE_OPTIMIZERS if args.front_page else DEFAULT_OPTIMIZERS)
    if args.out is None:
        args.out = DEFAULT_OUT / args.preset
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.lr is not None and not args.lr > 0:  # also refuses nan
        parser.error(f"--lr must be > 0, got {args.lr}")
    if args.batch_size is not None and args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.block_steps < 1:
        parser.error(f"--block-steps must be >= 1, got {args.block_steps}")
    if not args.grad_clip >= 0:  # also refuses nan
        parser.error(f"--grad-clip must be >= 0, got {args.grad_clip}")
    if args.release_gradients and args.grad_clip:
        parser.error("--release-gradients frees each gradient during backward, so there is no global "
                     "norm to clip: add --grad-clip 0")
    previous = args.out / "results.json"
    if previous.is_file() and not args.overwrite:
        try:
            other = json.loads(previous.read_text())["config"].get("preset")
        except (ValueError, KeyError, TypeError):
            other = "unreadable"
        if other != args.preset:
            parser.error(f"{args.out}/ holds the results of another preset ({other}), not {args.preset}'s: "
                         "choose another --out, or add --overwrite to replace them")
    return args


def prepare_cpu_kernel(names: list[str], device: torch.device) -> dict | None:
    """Build or load the C++ CPU step before any optimizer is timed, so its build (tens of
    seconds the first time on a machine) lands in no row's first step; what it took."""
    if device.type != "cpu" or not any(name.startswith("lowbit_") for name in names):
        return None

    built = not cpu_kernel.library_path().is_file()
    start = time.perf_counter()
    available = cpu_kernel.load()
    return {"built": built, "seconds": time.perf_counter() - start, "available": available}


def kernel_line(kernel: dict) -> str:
    verb = "built" if kernel["built"] else "loaded"
    line = f"C++ CPU step: {verb} in {kernel['seconds']:.1f} s, before any optimizer was timed"
    return line if kernel["available"] else f"{line}; not available, the compiled step serves instead"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list_optimizers:
        print(list_optimizers())
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was asked for, but torch sees no CUDA device")
    names, skipped = harness.resolve_optimizers(args.optimizers, all_names=ALL_OPTIMIZERS)
    if skipped:
        print(f"skipped (not installed): {', '.join(skipped)}", file=sys.stderr)
    if not names:
        raise SystemExit("no optimizer to run")
    preset = dict(PRESETS[args.model_size], **(FRONT_PAGE_RUN if args.front_page else {}))
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
    for name in OUTPUTS:
        (args.out / name).unlink(missing_ok=True)
    references = any(harness.OPTIMIZERS[name].reference for name in names)
    multi_seed = len(seeds) > 1
    run_line = (f"{args.model_size} preset: {steps} steps of {preset['batch_size']} x "
                f"{preset['model'].context} bytes, seeds {seeds}, optimizers in turns of "
                f"{min(args.block_steps, steps)} steps"
                f"{', activation checkpointing' if args.activation_checkpointing else ''}"
                f"{', gradients released' if args.release_gradients else ''}")
    heading = f"{run_line}; {machine}"
    kernel = None

    def write_results(runs: dict[str, list[dict]], elapsed: float) -> list[dict]:
        """results.json and table.md for what has been measured so far (runs stopped part way
        included, labelled so): rewritten after every turn, so a run stopped early (Ctrl-C, a
        time limit) keeps what it measured."""
        measured = {name: seed_runs for name, seed_runs in runs.items() if seed_runs}
        rows = summarize(measured)
        config = {
            "preset": args.preset, "model_size": args.model_size, "model": preset["model"].as_dict(),
            **{k: v for k, v in config_for(seeds[0]).__dict__.items() if k not in ("model", "seed")},
            "seeds": seeds, "optimizers": names, "skipped": skipped, "block_steps": args.block_steps,
            "finished": [name for name, seed_runs in measured.items()
                         if len(seed_runs) == len(seeds) and seed_runs[-1]["complete"]],
            "device": str(device), "corpus": corpus.describe(), "cpu_kernel": kernel, "wall_s": elapsed,
        }
        all_runs = [run for seed_runs in measured.values() for run in seed_runs]
        harness.write_json(args.out / "results.json", "train", rows, env=env,
                           config={**config, "runs": all_runs})
        table = harness.markdown_table(rows, table_columns(
            multi_seed, any("val_gap_vs_reference_pct" in row for row in rows)))
        (args.out / "table.md").write_text(f"{rows[0]['params'] / 1e6:.2f}M params, {heading}\n\n{table}\n")
        return rows

    print(heading, flush=True)
    start = time.perf_counter()
    finished: dict[str, list[dict]] = {name: [] for name in names}
    live: dict[str, TrainingRun] = {}

    def measured_so_far() -> dict[str, list[dict]]:
        return {name: finished[name] + ([live[name].result()] if name in live and live[name].steps_done
                                        else []) for name in names}

    terminal = TerminalTable.for_run(names, references)
    try:
        kernel = prepare_cpu_kernel(names, device)
        if kernel is not None:
            print(kernel_line(kernel), flush=True)
        with tqdm(total=steps * len(names) * len(seeds), desc="training", unit="step",
                  mininterval=2.0, file=sys.stderr) as progress:
            for seed in seeds:
                live = {name: TrainingRun(name, config_for(seed), corpus, device) for name in names}
                # Every first step (compilation, state allocation) before any step is timed.
                for run in live.values():
                    run.advance(progress)
                turns = {name: (lambda run=run: run.advance(progress)) for name, run in live.items()}
                while not all(run.done for run in live.values()):
                    harness.alternated_seconds(turns, rounds=1, calls=args.block_steps)
                    write_results(measured_so_far(), time.perf_counter() - start)
                for name, run in live.items():
                    finished[name].append(run.result())
                live = {}
                seed_rows = summarize({name: [runs[-1]] for name, runs in finished.items()})
                progress.clear()
                heading_line = f"\nseed {seed}:" if multi_seed else ""
                print(heading_line, terminal.render(seed_rows), sep="\n", flush=True)
    except KeyboardInterrupt:
        measured = {name: runs for name, runs in measured_so_far().items() if runs}
        if not measured:
            print(f"\nstopped (Ctrl-C) before any training step ended: nothing kept in {args.out}/",
                  file=sys.stderr)
        else:
            write_results(measured_so_far(), time.perf_counter() - start)
            kept = ", ".join(f"{name} {runs[-1]['steps_done']}/{steps} steps"
                             for name, runs in measured.items())
            print(f"\nstopped (Ctrl-C): kept {kept} in {args.out}/results.json and table.md", file=sys.stderr)
        return INTERRUPTED
    elapsed = time.perf_counter() - start
    rows = write_results(finished, elapsed)
    written = ["results.json", "table.md"]
    if multi_seed:
        print(f"\nmeans over seeds {seeds}:\n{terminal.render(rows)}")
    try:
        from lowbit_optim.bench import plots
    except ImportError as error:  # matplotlib is in the [bench] extra; the table does not need it
        print(f"plots skipped ({error}); pip install matplotlib to draw them", file=sys.stderr)
    else:
        labelled = {harness.OPTIMIZERS[name].label: seed_runs for name, seed_runs in finished.items()}
        plots.loss_curves(labelled, args.out / "loss_curves.png", f"{run_line}\n{machine}")
        plots.memory_bars(rows, args.out / "memory.png", f"{run_line}\n{machine}")
        written += ["loss_curves.png", "memory.png"]
        if args.front_page:
            plots.front_page(rows, args.out / "front_page.png", machine)
            written.append("front_page.png")
    if args.front_page:
        (args.out / "front_page.md").write_text(
            f"{harness.markdown_table(rows, FRONT_PAGE_COLUMNS)}\n\n{heading}\n")
        written.append("front_page.md")
    print(f"\n{LEGEND}\n{elapsed:.0f} s; wrote {', '.join(written)} in {args.out}/ "
          "(table.md and results.json: every column)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

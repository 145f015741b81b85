"""Which momentum format keeps Muon's loss: fp32, 8-bit and every 4-bit method, trained alike.

The main benchmark's byte-level GPT (lowbit_optim.bench) trains with Muon as it is used in
practice: the reference Muon (lowbit_optim.reference.muon) for the 2-D hidden weights (attention
and MLP matrices), fp32 ``torch.optim.AdamW`` for the embeddings (the tied output head), norms
and biases, one warmup + cosine schedule for both. Only the Muon momentum's storage changes
between rows (lowbit_optim.reference.momentum_codecs); each row trains with the same seeds,
initial weights and batches. The table gives the state bytes per parameter of each storage on a
1024 x 1024 weight and the final validation loss's gap to fp32 Muon, paired by seed.

    python benchmarks/bench_muon_methods.py                  # every method, 3 seeds
    python benchmarks/bench_muon_methods.py --methods fp32 dynamic4 rotated-normal4-sr --seeds 0
"""

import argparse
import concurrent.futures
import json
import multiprocessing
import pathlib
import statistics
import sys
import time

import torch
from torch.optim.lr_scheduler import LambdaLR

from lowbit_optim.bench import harness
from lowbit_optim.bench.data import batch_offsets, get_batch, load_corpus
from lowbit_optim.bench.model import ByteGPT, ModelConfig
from lowbit_optim.bench.train import Evaluator, TrainConfig, warmup_cosine
from lowbit_optim.formats import catalog
from lowbit_optim.reference import momentum_codecs as codecs
from lowbit_optim.reference.muon import ReferenceMuon

# The main benchmark's "quick" model, trained long enough (past the ~3.1-nat unigram plateau)
# for a few-percent loss gap to stand out of the seed noise.
MODEL = ModelConfig(d_model=64, n_layers=2, n_heads=2, context=64)
STEPS, BATCH_SIZE = 250, 16
# Muon's usual LR (Jordan et al.) for the hidden matrices; the main benchmark's AdamW LR for the rest.
MUON_LR, ADAMW_LR = 0.02, 3e-3
WEIGHT_DECAY, BETAS, GRAD_CLIP = 0.1, (0.9, 0.95), 1.0

Dyn8, Dyn4 = catalog.DYNAMIC_8BIT_SIGNED, catalog.DYNAMIC_4BIT_SIGNED
Lin8, Lin4, Nf4 = codecs.LINEAR_8BIT_SIGNED, codecs.LINEAR_4BIT_SIGNED, codecs.NORMAL_4BIT


def blockwise(fmt, block_size, **options):
    return lambda seed: codecs.BlockwiseMomentum(fmt, block_size, seed=seed, **options)


def error_feedback(main, residual):
    return lambda seed: codecs.ErrorFeedbackMomentum(main(seed), residual(seed))


# name: (what it is, the codec for a seed). Maps: "dynamic" the package's signed dynamic-exponent
# maps, "linear" symmetric absmax integers (k / 127, k / 7), "normal" NF4's Gaussian quantiles.
METHODS = {
    "fp32": ("fp32 (torch.optim.Muon)", lambda seed: codecs.FloatMomentum()),
    "dynamic8": ("8-bit dynamic map", blockwise(Dyn8, 256)),
    "linear8-2048": ("8-bit linear int8", blockwise(Lin8, 2048)),
    "dynamic4": ("4-bit dynamic map", blockwise(Dyn4, 128)),
    "dynamic4-64": ("4-bit dynamic map", blockwise(Dyn4, 64)),
    "dynamic4-32": ("4-bit dynamic map", blockwise(Dyn4, 32)),
    "dynamic4-sr": ("4-bit dynamic map, stochastic rounding", blockwise(Dyn4, 128, stochastic_rounding=True)),
    "linear4": ("4-bit linear int4", blockwise(Lin4, 128)),
    "normal4": ("4-bit normal quantiles", blockwise(Nf4, 128)),
    "normal4-64": ("4-bit normal quantiles", blockwise(Nf4, 64)),
    "rotated-linear4": ("Hadamard + 4-bit linear int4", blockwise(Lin4, 128, rotate=True)),
    "rotated-normal4": ("Hadamard + 4-bit normal quantiles", blockwise(Nf4, 128, rotate=True)),
    "rotated-normal4-64": ("Hadamard + 4-bit normal quantiles", blockwise(Nf4, 64, rotate=True)),
    "rotated-linear4-sr": ("Hadamard + 4-bit linear int4, stochastic rounding",
                           blockwise(Lin4, 128, rotate=True, stochastic_rounding=True)),
    "rotated-normal4-sr": ("Hadamard + 4-bit normal quantiles, stochastic rounding",
                           blockwise(Nf4, 128, rotate=True, stochastic_rounding=True)),
    "dynamic4-ef4": ("4-bit dynamic map, error feedback: residual in 4-bit",
                     error_feedback(blockwise(Dyn4, 128), blockwise(Dyn4, 128))),
}
BASELINE = "fp32"


def codec_bits_and_block(codec) -> tuple[str, str]:
    if isinstance(codec, codecs.FloatMomentum):
        return str(torch.finfo(codec.dtype).bits), "-"
    if isinstance(codec, codecs.ErrorFeedbackMomentum):
        main, residual = codec_bits_and_block(codec.main), codec_bits_and_block(codec.residual)
        return f"{main[0]} + {residual[0]}", main[1]
    return str(codec.fmt.bits), str(codec.block_size)


def bytes_per_param_of_square_weight(codec, size: int = 1024) -> float:
    """Momentum state bytes per parameter of a ``size x size`` weight, every part counted."""
    return codec.state_bytes(codec.init(torch.zeros(size, size))) / size**2


def split_parameters(model: ByteGPT) -> tuple[list, list]:
    """Muon's share (the blocks' 2-D matrices) and AdamW's (embeddings, norms, biases)."""
    hidden = [p for block in model.blocks for p in block.parameters() if p.ndim == 2]
    hidden_ids = {id(p) for p in hidden}
    return hidden, [p for p in model.parameters() if id(p) not in hidden_ids]


def train(method: str, config: TrainConfig, corpus, device: torch.device) -> dict:
    torch.manual_seed(config.seed)
    model = ByteGPT(config.model).to(device)
    hidden, rest = split_parameters(model)
    codec = METHODS[method][1](config.seed)
    muon = ReferenceMuon(hidden, lr=MUON_LR, weight_decay=config.weight_decay, codec=codec)
    adamw = torch.optim.AdamW(rest, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    schedulers = [LambdaLR(optimizer, warmup_cosine(config)) for optimizer in (muon, adamw)]
    offsets = batch_offsets(corpus.train, count=config.steps, batch_size=config.batch_size,
                            context=config.model.context, seed=config.seed)
    evaluator = Evaluator(corpus, config, device)
    train_losses = []
    for step in range(config.steps):
        loss = model(*get_batch(corpus.train, offsets[step], config.model.context, device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        train_losses.append(loss.item())
        for optimizer in (muon, adamw):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        for scheduler in schedulers:
            scheduler.step()
    return {
        "method": method, "seed": config.seed,
        "muon_params": sum(p.numel() for p in hidden), "adamw_params": sum(p.numel() for p in rest),
        "muon_state_bytes": muon.state_bytes(),
        "final_train_loss": evaluator.loss(model, "train"),
        "final_val_loss": evaluator.loss(model, "val"),
        "last_batch_losses": train_losses[-10:],
    }


def train_in_worker(method: str, seed: int, steps: int) -> dict:
    """One run in its own process on one thread: the runs are independent, and one thread each
    keeps parallel runs from oversubscribing the cores."""
    torch.set_num_threads(1)
    return train(method, train_config(seed, steps), load_corpus(), torch.device("cpu"))


def train_config(seed: int, steps: int) -> TrainConfig:
    return TrainConfig(model=MODEL, steps=steps, batch_size=BATCH_SIZE, lr=ADAMW_LR,
                       weight_decay=WEIGHT_DECAY, betas=BETAS, min_lr_ratio=0.1,
                       warmup_steps=max(1, steps // 10), eval_every=steps, eval_batches=8, seed=seed,
                       grad_clip=GRAD_CLIP)


def summarize(runs: dict[str, list[dict]]) -> list[dict]:
    baseline = {run["seed"]: run["final_val_loss"] for run in runs.get(BASELINE, [])}
    rows = []
    for method, seed_runs in runs.items():
        codec = METHODS[method][1](0)
        bits, block = codec_bits_and_block(codec)
        val = [run["final_val_loss"] for run in seed_runs]
        row = {
            "method": method, "description": METHODS[method][0], "bits": bits, "block": block,
            "bytes_per_param_1024": bytes_per_param_of_square_weight(codec),
            "seeds": [run["seed"] for run in seed_runs], "final_val_loss_per_seed": val,
            "final_val_loss": statistics.mean(val),
            "val_loss_sd": statistics.stdev(val) if len(val) > 1 else None,
        }
        gaps = [100 * (run["final_val_loss"] / baseline[run["seed"]] - 1)
                for run in seed_runs if run["seed"] in baseline]
        if gaps:
            row["val_gap_pct"] = statistics.mean(gaps)
            row["val_gap_pct_sd"] = statistics.stdev(gaps) if len(gaps) > 1 else None
            row["val_gap_pct_range"] = [min(gaps), max(gaps)]
        rows.append(row)
    return rows


COLUMNS = [
    harness.Column("method", "method"),
    harness.Column("storage", "description"),
    harness.Column("bits", "bits"),
    harness.Column("block", "block"),
    harness.Column("state B/param", "bytes_per_param_1024", "{:.3f}"),
    harness.Column("val loss", "final_val_loss", "{:.4f}"),
    harness.Column("val sd", "val_loss_sd", "{:.4f}"),
    harness.Column("gap vs fp32", "val_gap_pct", "{:+.2f}%"),
    harness.Column("gap sd", "val_gap_pct_sd", "{:.2f}"),
]


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS),
                        metavar="METHOD", help=f"storages to train with (default: all of {list(METHODS)}); "
                             f"gaps are measured against {BASELINE!r}, in the same run or --merge'd")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--jobs", type=int, default=2, help="runs trained at once, one thread each")
    parser.add_argument("--merge", type=pathlib.Path, nargs="+", metavar="JSON",
                        help="train nothing: one table from the runs of earlier outputs (a study "
                             "split over processes or machines; the first run of a method and seed wins)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench_out/muon_methods.json"))
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    return args


def heading_for(config: dict, env: dict) -> str:
    model = config["model"]
    return (f"byte GPT (d_model {model['d_model']}, {model['n_layers']} layers), {config['steps']} steps "
            f"of {config['batch_size']} x {model['context']} bytes, Muon LR {config['muon_lr']} on the "
            f"hidden matrices, AdamW LR {config['adamw_lr']} on the rest, seeds {config['seeds']}, one "
            f"thread per run; {harness.machine_line(env)}")


def merge(paths: list[pathlib.Path], out: pathlib.Path) -> int:
    payloads = [json.loads(path.read_text()) for path in paths]
    runs: dict[str, dict[int, dict]] = {}
    for payload in payloads:
        for run in payload["config"]["runs"]:
            runs.setdefault(run["method"], {}).setdefault(run["seed"], run)
    ordered = {method: [seed_runs[seed] for seed in sorted(seed_runs)]
               for method in METHODS if (seed_runs := runs.get(method))}
    config = {**payloads[0]["config"], "merged_from": [str(path) for path in paths],
              "runs": [run for seed_runs in ordered.values() for run in seed_runs]}
    env = payloads[0]["environment"]
    harness.report(out, "muon_methods", summarize(ordered), COLUMNS, heading=heading_for(config, env),
                   env=env, config=config)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.merge:
        return merge(args.merge, args.out)
    env = harness.environment(torch.device("cpu"))
    runs: dict[str, list[dict]] = {method: [] for method in args.methods}
    start = time.perf_counter()

    def write_results() -> tuple[list[dict], dict]:
        """The JSON of the runs finished so far: rewritten after every run, so a study stopped
        part way (Ctrl-C, a time limit) keeps what it measured (``--merge`` combines such files)."""
        finished = {method: sorted(seed_runs, key=lambda run: run["seed"])
                    for method, seed_runs in runs.items() if seed_runs}
        config = {"model": MODEL.as_dict(), "steps": args.steps, "batch_size": BATCH_SIZE,
                  "muon_lr": MUON_LR, "adamw_lr": ADAMW_LR, "weight_decay": WEIGHT_DECAY,
                  "betas": BETAS, "grad_clip": GRAD_CLIP, "seeds": args.seeds,
                  "wall_s": time.perf_counter() - start,
                  "runs": [run for seed_runs in finished.values() for run in seed_runs]}
        rows = summarize(finished)
        harness.write_json(args.out, "muon_methods", rows, env=env, config=config)
        return rows, config

    # spawn, not fork: a forked child inherits torch's thread pool half-initialised.
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
        futures = [pool.submit(train_in_worker, method, seed, args.steps)
                   for method in args.methods for seed in args.seeds]
        for future in concurrent.futures.as_completed(futures):
            run = future.result()
            runs[run["method"]].append(run)
            write_results()
            print(f"{run['method']} seed {run['seed']}: val {run['final_val_loss']:.4f} "
                  f"({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    rows, config = write_results()
    harness.report(args.out, "muon_methods", rows, COLUMNS, heading=heading_for(config, env), env=env,
                   config=config)
    return 0


if __name__ == "__main__":
    sys.exit(main())

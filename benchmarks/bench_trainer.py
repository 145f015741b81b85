"""Hugging Face Trainer: a 6-step run of a ~460k-parameter GPT-2 with each ``optim`` string.

What a fine-tuning user sees when they switch ``TrainingArguments(optim=...)``: the wall time of
``trainer.train()`` in a fresh process with an empty compile cache (compile included), its
first step, the median of the later steps, and the optimizer state's size. Each optimizer
runs in its own process with its own empty ``TORCHINDUCTOR_CACHE_DIR``; optimizers whose
package is missing (bitsandbytes, torchao) are skipped.

    python benchmarks/bench_trainer.py                 # table + bench_out/bench_trainer.json
    python benchmarks/bench_trainer.py --optims lowbit_adamw_4bit adamw_torch_4bit
"""

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

import torch

from lowbit_optim import state_bytes
from lowbit_optim.bench import harness

# HF optim string -> the distribution it needs beyond torch and lowbit_optim.
OPTIMS = {
    "adamw_torch": None,
    "lowbit_adamw_8bit": None,
    "lowbit_adamw_4bit": None,
    "adamw_bnb_8bit": "bitsandbytes",
    "adamw_torch_8bit": "torchao",
    "adamw_torch_4bit": "torchao",
}
STEPS, BATCH, SEQ_LEN = 6, 8, 128
MODEL = dict(vocab_size=256, n_positions=256, n_embd=128, n_layer=2, n_head=4)


def measure(optim: str) -> dict:
    """One Trainer run in this process (the worker side)."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from lowbit_optim.integrations.transformers import register

    register()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**MODEL, bos_token_id=0, eos_token_id=0))
    tokens = torch.randint(0, 256, (STEPS * BATCH, SEQ_LEN))
    dataset = [{"input_ids": row, "labels": row} for row in tokens]

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.seconds = []

        def on_step_begin(self, *args, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            self.seconds.append(time.perf_counter() - self.start)

    timer = StepTimer()
    with tempfile.TemporaryDirectory(prefix="bench_trainer_") as output_dir:
        args = TrainingArguments(
            output_dir=output_dir, optim=optim, max_steps=STEPS, per_device_train_batch_size=BATCH,
            learning_rate=1e-3, weight_decay=0.01, logging_steps=1, save_strategy="no",
            report_to="none", use_cpu=True, disable_tqdm=True, seed=0,
        )
        trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[timer])
        start = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - start
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    params = sum(p.numel() for p in model.parameters())
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {
        "optim": optim,
        "load_average_1min": os.getloadavg()[0],
        "optimizer_class": f"{type(optimizer).__module__}.{type(optimizer).__name__}",
        "params": params,
        "train_s": train_s,
        "first_step_s": timer.seconds[0],
        "later_step_ms": 1e3 * statistics.median(timer.seconds[1:]),
        "graphs": harness.compiled_graphs(),
        "state_bytes_per_param": state_bytes(optimizer) / params,
        "final_loss": losses[-1],
    }


def run_isolated(optim: str) -> dict:
    return harness.run_worker(__file__, [optim], cold_cache=True)


COLUMNS = [
    harness.Column("optim", "optim"),
    harness.Column("train() s, cold cache", "train_s", "{:.1f}"),
    harness.Column("first step s", "first_step_s", "{:.2f}"),
    harness.Column("later steps ms (median)", "later_step_ms", "{:.0f}"),
    harness.Column("graphs", "graphs"),
    harness.Column("state B/param", "state_bytes_per_param", "{:.2f}"),
    harness.Column(f"loss after {STEPS}", "final_loss", "{:.3f}"),
    harness.Column("load avg", "load_average_1min", "{:.1f}"),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--optims", nargs="+", default=list(OPTIMS), choices=list(OPTIMS))
    parser.add_argument("--repeats", type=int, default=2,
                        help="fresh cold-cache runs per optimizer; the fastest is reported (default 2)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench_out/bench_trainer.json"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(args.worker)))
        return 0

    rows = []
    for optim in args.optims:
        package = OPTIMS[optim]
        if package is not None and harness.package_version(package) is None:
            print(f"skipped {optim} ({package} not installed)", file=sys.stderr)
            continue
        print(f"{optim} ...", file=sys.stderr, flush=True)
        # Other work on a shared machine only ever adds time: keep the fastest run.
        runs = [run_isolated(optim) for _ in range(args.repeats)]
        rows.append({**min(runs, key=lambda row: row["train_s"]), "runs": args.repeats})
    env = harness.environment(torch.device("cpu"))
    env["versions"]["transformers"] = harness.package_version("transformers")
    config = {"model": f"GPT-2 {MODEL}", "steps": STEPS, "batch": BATCH, "seq_len": SEQ_LEN,
              "cache": "cold", "repeats": args.repeats}
    harness.report(args.out, "trainer", rows, COLUMNS, env=env, config=config,
                   heading=f"GPT-2 ({rows[0]['params'] / 1e3:.0f}k params), {STEPS} Trainer steps of "
                           f"{BATCH} x {SEQ_LEN} tokens, cold compile cache, fastest of "
                           f"{args.repeats} runs; {harness.machine_line(env)}, "
                           f"transformers {env['versions']['transformers']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One training run: the same model, batches, seed and LR schedule for every optimizer.

What is measured and how:
- state bytes: ``lowbit_optim.state_bytes`` after training (the moments' tensors, inner
  tensors of quantized states; fp32 AdamW is 8 bytes/param; master weight corrections).
- training bytes: what persists for training, per parameter: the parameters, the optimizer
  state (moments and corrections) and the gradients held when the last step begins (after
  backward; none where the step ran during backward).
- optimizer step time: wall time of ``optimizer.step()`` alone; the first call (which
  compiles, for compiled optimizers) is reported separately, the rest as a median. The
  train step time adds forward, backward and ``zero_grad``.
- recompiles: Dynamo graphs compiled after the first step (should be 0: the LR changes every
  step).
- peak memory: the most tensor memory live at once during a training step (parameters,
  gradients, optimizer state, activations, temporaries). On CUDA it is
  ``torch.cuda.max_memory_allocated`` over all steps after the first; on CPU, where no such
  counter exists, it is the tensors live before one extra step after training (parameters,
  buffers, optimizer state) plus the highest point of the allocations the profiler records
  during that step. Process RSS is not used: the interpreter, libraries and compiler make it
  hundreds of MB and hide a few MB of optimizer state.
"""

import functools
import math
from dataclasses import dataclass

import torch
from torch.optim.lr_scheduler import LambdaLR

from lowbit_optim.bench import harness
from lowbit_optim.bench.data import Corpus, batch_offsets, get_batch
from lowbit_optim.bench.model import ByteGPT, ModelConfig
from lowbit_optim.bench.profiling import allocation_peak_bytes
from lowbit_optim.optim.release import release_gradients
from lowbit_optim.optim.released_gradient import is_released
from lowbit_optim.state import state_bytes


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig
    steps: int
    batch_size: int
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    warmup_steps: int
    min_lr_ratio: float
    eval_every: int
    eval_batches: int
    seed: int
    # Clip the global gradient norm to this before each step (the GPT recipe), or None.
    grad_clip: float | None = None
    # The parameters' dtype ("float32" or "bfloat16"; the model computes in it too), unless
    # the optimizer's row fixes its own (``OptimizerSpec.param_dtype``).
    param_dtype: str = "float32"
    # Step each parameter during backward and free its gradient (``release_gradients``).
    release_gradients: bool = False


def warmup_cosine(config: TrainConfig):
    """LR multiplier: linear warmup, then cosine decay to ``min_lr_ratio`` (for ``LambdaLR``)."""
    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine
    return factor


# Evaluation windows come from their own fixed seeds, not the run's: every optimizer and every
# training seed is scored on the same text, so a seed changes only the initial weights and the
# batch order. (Windows drawn per seed made the validation loss of one fp32 run move by 0.12
# nats between seeds from the text alone.)
EVAL_SEEDS = {"train": 10_000, "val": 20_000}


class Evaluator:
    """Mean loss on fixed windows of the train and validation text (the same for everyone)."""

    def __init__(self, corpus: Corpus, config: TrainConfig, device: torch.device):
        self.corpus, self.device, self.context = corpus, device, config.model.context
        self.offsets = {
            split: batch_offsets(getattr(corpus, split), count=config.eval_batches,
                                 batch_size=config.batch_size, context=self.context, seed=seed)
            for split, seed in EVAL_SEEDS.items()
        }

    @torch.no_grad()
    def loss(self, model: ByteGPT, split: str) -> float:
        data = getattr(self.corpus, split)
        model.eval()
        losses = [model(*get_batch(data, offsets, self.context, self.device)).item()
                  for offsets in self.offsets[split]]
        model.train()
        return sum(losses) / len(losses)


def held_gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    """The gradients the parameters hold (not the storage-less stand-ins of released ones)."""
    return [p.grad for p in model.parameters() if p.grad is not None and not is_released(p.grad)]


def live_model_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    tensors = [*model.parameters(), *model.buffers(), *held_gradients(model)]
    return sum(t.nbytes for t in tensors) + state_bytes(optimizer, include_step=True)


def cpu_step_peak_bytes(train_step, model, optimizer) -> int:
    """Peak tensor bytes during one ``train_step()`` on CPU (see the module docstring)."""
    return live_model_bytes(model, optimizer) + allocation_peak_bytes(train_step)


def train(name: str, config: TrainConfig, corpus: Corpus, device: torch.device,
          progress=None) -> dict:
    """Train ``ByteGPT`` with optimizer ``name``; returns one result row (see module doc)."""
    torch.manual_seed(config.seed)
    param_dtype = harness.OPTIMIZERS[name].param_dtype or config.param_dtype
    model = ByteGPT(config.model).to(device=device, dtype=getattr(torch, param_dtype))
    num_params = sum(p.numel() for p in model.parameters())
    optimizer = harness.make_optimizer(name, model.parameters(), lr=config.lr,
                                       betas=config.betas, weight_decay=config.weight_decay)
    scheduler = LambdaLR(optimizer, warmup_cosine(config))
    if config.release_gradients:
        release_gradients(optimizer)  # refuses an optimizer that is not ours
    offsets = batch_offsets(corpus.train, count=config.steps, batch_size=config.batch_size,
                            context=config.model.context, seed=config.seed)
    evaluator = Evaluator(corpus, config, device)

    def forward_backward(step: int) -> None:
        loss = model(*get_batch(corpus.train, offsets[step], config.model.context, device))
        loss.backward()
        if config.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        train_losses.append(loss.item())

    step_seconds, train_step_seconds, train_losses = [], [], []
    curve = {"step": [], "train_loss": [], "val_loss": [], "lr": []}
    first_step_s = graphs_after_first = None
    for step in range(config.steps):
        forward_s = harness.timed(functools.partial(forward_backward, step), device)
        held_gradient_bytes = sum(grad.nbytes for grad in held_gradients(model))
        optimizer_s = harness.timed(optimizer.step, device)
        optimizer.zero_grad(set_to_none=True)
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        if step == 0:
            first_step_s = optimizer_s
            graphs_after_first = harness.compiled_graphs()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
        else:
            step_seconds.append(optimizer_s)
            train_step_seconds.append(forward_s + optimizer_s)
        last = step == config.steps - 1
        if (step + 1) % config.eval_every == 0 or last:
            curve["step"].append(step + 1)
            curve["train_loss"].append(evaluator.loss(model, "train"))
            curve["val_loss"].append(evaluator.loss(model, "val"))
            curve["lr"].append(float(lr))
        if progress is not None:
            progress.update(1)
            progress.set_postfix(opt=name, loss=f"{train_losses[-1]:.3f}", refresh=False)
    recompiles = harness.compiled_graphs() - graphs_after_first

    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:
        def extra_step():
            forward_backward(0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        peak = cpu_step_peak_bytes(extra_step, model, optimizer)

    moments = state_bytes(optimizer)
    training_bytes = sum(p.nbytes for p in model.parameters()) + moments + held_gradient_bytes
    return {
        "optimizer": name,
        "label": harness.OPTIMIZERS[name].label,
        "seed": config.seed,
        "params": num_params,
        "state_bytes": moments,
        "state_bytes_per_param": moments / num_params,
        "param_dtype": param_dtype,
        "release_gradients": config.release_gradients,
        "training_bytes_per_param": training_bytes / num_params,
        "peak_memory_bytes": peak,
        "first_step_s": first_step_s,
        "step_ms": harness.median_ms(step_seconds),
        "train_step_ms": harness.median_ms(train_step_seconds),
        "recompiles_after_first_step": recompiles,
        "final_train_loss": curve["train_loss"][-1],
        "final_val_loss": curve["val_loss"][-1],
        "curve": curve,
        "nonfinite_loss": any(not math.isfinite(x) for x in train_losses),
    }

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
- recompiles: Dynamo graphs compiled during the run's own steps after the first (should be
  0: the LR changes every step).
- peak memory: the most tensor memory live at once during a training step (parameters,
  gradients, optimizer state, activations, temporaries). On CUDA it is
  ``torch.cuda.max_memory_allocated`` over all steps after the first, less what the other
  runs taking turns with this one hold; on CPU, where no such
  counter exists, it is the tensors live before one extra step after training (parameters,
  buffers, optimizer state) plus the highest point of the allocations the profiler records
  during that step. Process RSS is not used: the interpreter, libraries and compiler make it
  hundreds of MB and hide a few MB of optimizer state.
"""

import contextlib
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


class TrainingRun:
    """``ByteGPT`` trained with optimizer ``name``, a few steps at a time (see module doc).

    Several runs can take turns (``python -m lowbit_optim.bench`` interleaves them, so that a
    busy minute of a shared machine slows every optimizer alike) and each still trains exactly
    as it would alone: it keeps its own model, batches and random stream (stochastic rounding
    draws from torch's global generator, which is swapped in for the run's own steps only),
    and it counts only the graphs compiled during its own steps as its recompiles.
    """

    def __init__(self, name: str, config: TrainConfig, corpus: Corpus, device: torch.device):
        self.name, self.config, self.corpus, self.device = name, config, corpus, device
        with self._own_random_stream(seeded=True):
            spec = harness.OPTIMIZERS[name]
            self.param_dtype = spec.param_dtype or config.param_dtype
            self.model = ByteGPT(config.model).to(device=device, dtype=getattr(torch, self.param_dtype))
            params = self.model if spec.takes_module else self.model.parameters()
            self.optimizer = harness.make_optimizer(name, params, lr=config.lr,
                                                    betas=config.betas, weight_decay=config.weight_decay)
            self.scheduler = LambdaLR(self.optimizer, warmup_cosine(config))
            if config.release_gradients:
                release_gradients(self.optimizer)  # refuses an optimizer that is not ours
        self.offsets = batch_offsets(corpus.train, count=config.steps, batch_size=config.batch_size,
                                     context=config.model.context, seed=config.seed)
        self.evaluator = Evaluator(corpus, config, device)
        self.steps_done = 0
        self.step_seconds, self.train_step_seconds, self.train_losses = [], [], []
        self.curve = {"step": [], "train_loss": [], "val_loss": [], "lr": []}
        self.first_step_s = None
        self.recompiles = 0
        self.held_gradient_bytes = 0
        self.peak_memory_bytes = None

    @property
    def done(self) -> bool:
        return self.steps_done == self.config.steps

    @contextlib.contextmanager
    def _own_random_stream(self, seeded: bool = False):
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            if seeded:
                torch.manual_seed(self.config.seed)
            else:
                torch.set_rng_state(self.rng_state)
                if devices:
                    torch.cuda.set_rng_state(self.cuda_rng_state, self.device)
            yield
            self.rng_state = torch.get_rng_state()
            if devices:
                self.cuda_rng_state = torch.cuda.get_rng_state(self.device)

    def _forward_backward(self, step: int) -> None:
        config = self.config
        batch = get_batch(self.corpus.train, self.offsets[step], config.model.context, self.device)
        loss = self.model(*batch)
        loss.backward()
        if config.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), config.grad_clip)
        self.train_losses.append(loss.item())

    def advance(self, progress=None) -> None:
        """One training step (nothing once the run is done); the last one also measures the
        CPU peak memory (one extra, untimed step)."""
        if self.done:
            return
        step, device = self.steps_done, self.device
        graphs_before = harness.compiled_graphs()
        on_cuda = device.type == "cuda" and step > 0
        if on_cuda:  # this run's own peak, whatever the other runs' tensors take
            others = torch.cuda.memory_allocated(device) - live_model_bytes(self.model, self.optimizer)
            torch.cuda.reset_peak_memory_stats(device)
        with self._own_random_stream():
            forward_s = harness.timed(functools.partial(self._forward_backward, step), device)
            self.held_gradient_bytes = sum(grad.nbytes for grad in held_gradients(self.model))
            optimizer_s = harness.timed(self.optimizer.step, device)
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        if step == 0:
            self.first_step_s = optimizer_s
        else:
            self.recompiles += harness.compiled_graphs() - graphs_before
            self.step_seconds.append(optimizer_s)
            self.train_step_seconds.append(forward_s + optimizer_s)
        self.steps_done += 1
        if self.steps_done % self.config.eval_every == 0 or self.done:
            point = {"step": self.steps_done, "train_loss": self.evaluator.loss(self.model, "train"),
                     "val_loss": self.evaluator.loss(self.model, "val"), "lr": float(lr)}
            # One assignment, so that Ctrl-C during an evaluation (the benchmark keeps what a run
            # measured) never leaves the curve's lists of different lengths.
            self.curve = {key: [*values, point[key]] for key, values in self.curve.items()}
        if on_cuda:
            peak = torch.cuda.max_memory_allocated(device) - others
            self.peak_memory_bytes = max(self.peak_memory_bytes or 0, peak)
        if self.done and device.type != "cuda":
            def extra_step():
                self._forward_backward(0)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            with self._own_random_stream():
                self.peak_memory_bytes = cpu_step_peak_bytes(extra_step, self.model, self.optimizer)
        if progress is not None:
            progress.update(1)
            progress.set_postfix(opt=self.name, loss=f"{self.train_losses[-1]:.3f}", refresh=False)

    def result(self) -> dict:
        """The run's row: final once it is done; before that, what it has measured so far
        (``complete`` False; losses from its last evaluation, no peak memory on CPU)."""
        num_params = sum(p.numel() for p in self.model.parameters())
        moments = state_bytes(self.optimizer)
        training_bytes = sum(p.nbytes for p in self.model.parameters()) + moments + self.held_gradient_bytes
        evaluated = bool(self.curve["step"])
        return {
            "optimizer": self.name,
            "label": harness.OPTIMIZERS[self.name].label,
            "seed": self.config.seed,
            "complete": self.done,
            "steps_done": self.steps_done,
            "params": num_params,
            "state_bytes": moments,
            "state_bytes_per_param": moments / num_params,
            "param_dtype": self.param_dtype,
            "release_gradients": self.config.release_gradients,
            "training_bytes_per_param": training_bytes / num_params,
            "peak_memory_bytes": self.peak_memory_bytes,
            "first_step_s": self.first_step_s,
            "step_ms": harness.median_ms(self.step_seconds),
            "train_step_ms": harness.median_ms(self.train_step_seconds),
            "recompiles_after_first_step": self.recompiles,
            "loss_step": self.curve["step"][-1] if evaluated else None,
            "final_train_loss": self.curve["train_loss"][-1] if evaluated else None,
            "final_val_loss": self.curve["val_loss"][-1] if evaluated else None,
            "curve": self.curve,
            "nonfinite_loss": any(not math.isfinite(x) for x in self.train_losses),
        }


def train(name: str, config: TrainConfig, corpus: Corpus, device: torch.device,
          progress=None) -> dict:
    """Train ``ByteGPT`` with optimizer ``name`` alone, start to end; returns its row."""
    run = TrainingRun(name, config, corpus, device)
    while not run.done:
        run.advance(progress)
    return run.result()

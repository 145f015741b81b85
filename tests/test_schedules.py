"""No recompiles and no per-step device tensors, whatever changes the hyperparameters."""

import pytest
import torch
from conftest import slow_except
from helpers import SCHEDULE_STEPS as STEPS
from helpers import SCHEDULES, graph_count, seeded_mlp
from torch.optim import lr_scheduler

from lowbit_optim import AdamW4bit, AdamW8bit, AdamWFactored4bit, AdamWFp8


def make_model():
    # Whole blocks plus a tail (4160 = 32.5 blocks of 128), and fp32-state small tensors.
    return seeded_mlp(64, 65, 2, seed=None)


def train_step(model, optimizer):
    optimizer.zero_grad()
    loss = model(torch.randn(16, 64)).square().mean()
    loss.backward()
    optimizer.step()
    return loss





def transformers_cosine(opt):
    transformers = pytest.importorskip("transformers")
    return transformers.get_scheduler("cosine", opt, num_warmup_steps=5, num_training_steps=STEPS)


SCHEDULES["transformers.get_scheduler(cosine)"] = transformers_cosine


# Every scheduler with AdamW4bit and with the factored class (its statistics and update are
# compiled functions of their own); the other formats take their hyperparameters into the same
# compiled step as AdamW4bit, so one scheduler each (OneCycleLR: it changes the betas too), in the
# slow tier: their graphs are compiles of their own.
CASES = [(cls, name) for cls in (AdamW4bit, AdamWFactored4bit) for name in SCHEDULES] + [
    pytest.param(cls, "OneCycleLR", marks=pytest.mark.slow) for cls in (AdamW8bit, AdamWFp8)]


@pytest.mark.sweep
@pytest.mark.parametrize("cls, name", CASES, ids=lambda value: getattr(value, "__name__", value))
def test_schedulers_cause_no_recompiles(cls, name):
    model = make_model()
    optimizer = cls(model.parameters(), lr=1e-3, backend="compile")
    scheduler = SCHEDULES[name](optimizer)
    train_step(model, optimizer)  # the first step may compile
    graphs_after_first_step = graph_count(optimizer)
    assert graphs_after_first_step >= 1
    seen_lrs, seen_beta1 = set(), set()
    for _ in range(STEPS):
        loss = train_step(model, optimizer)
        if isinstance(scheduler, lr_scheduler.ReduceLROnPlateau):
            scheduler.step(1.0)  # a flat loss: the LR drops every step
        else:
            scheduler.step()
        group = optimizer.param_groups[0]
        seen_lrs.add(float(group["lr"]))
        seen_beta1.add(float(group["betas"][0]))
        assert torch.isfinite(loss)
    assert len(seen_lrs) > 3, "the schedule really changed the LR"
    if name == "OneCycleLR":
        assert len(seen_beta1) > 3, "OneCycleLR cycles beta1 too"
    assert graph_count(optimizer) == graphs_after_first_step
    assert isinstance(optimizer.param_groups[0]["lr"], float), "the group keeps the float LR"


@pytest.mark.parametrize("cls", [AdamW4bit, AdamWFactored4bit], ids=lambda c: c.__name__)
def test_every_manual_change_is_taken_without_recompiles(cls):
    model = make_model()
    optimizer = cls(model.parameters(), lr=1e-3, backend="compile")
    train_step(model, optimizer)
    graphs = graph_count(optimizer)
    group = optimizer.param_groups[0]
    lr_tensor = torch.tensor(1e-3)
    for step in range(STEPS):
        if step % 4 == 0:
            group["lr"] = 1e-3 / (step + 1)  # timm style: a plain float
            written = group["lr"]
        elif step % 4 == 1:
            group["lr"] = written = lr_tensor  # a tensor of the user's, then changed in place
        elif step % 4 == 2:
            group["lr"].fill_(2e-3 / (step + 1))
        else:
            group["betas"] = (0.9 - step * 0.01, 0.999 - step * 1e-4)
            group["eps"] = 1e-8 * (step + 1)
            group["weight_decay"] = 0.01 * step
        train_step(model, optimizer)
        assert group["lr"] is written, "the group keeps what the user wrote"
    assert graph_count(optimizer) == graphs

    # The float really reaches the step: LR 0 and no weight decay freeze the parameters.
    group["lr"], group["weight_decay"] = 0.0, 0.0
    before = [p.detach().clone() for p in model.parameters()]
    train_step(model, optimizer)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


@pytest.mark.parametrize("cls", slow_except([AdamW8bit, AdamWFp8, AdamWFactored4bit], AdamW8bit),
                         ids=lambda c: c.__name__)
def test_twelve_distinct_shapes_share_one_graph(cls):
    shapes = [(64 + 8 * i, 72 + 4 * i) for i in range(12)]  # 4608 .. 17424 elements
    assert len(set(shapes)) == 12
    small = [torch.nn.Parameter(torch.randn(96, 48))]
    many = [torch.nn.Parameter(torch.randn(*shape)) for shape in shapes]
    optimizer = cls(small, backend="compile")
    small[0].grad = torch.randn_like(small[0])
    optimizer.step()
    graphs_for_one_shape = graph_count(optimizer)
    optimizer = cls(many, backend="compile")
    for _ in range(2):
        for p in many:
            p.grad = torch.randn_like(p)
        optimizer.step()
    assert graph_count(optimizer) == graphs_for_one_shape


# Ops that make a tensor from Python numbers. Counted with the profiler, which sees the ops a
# compiled step really runs (a TorchDispatchMode would make Dynamo fall back to eager).
FACTORY_OPS = {"aten::scalar_tensor", "aten::lift_fresh", "aten::lift_fresh_copy", "aten::full",
               "aten::zeros", "aten::ones", "aten::tensor"}


@pytest.mark.parametrize("cls", [AdamW8bit, AdamWFactored4bit], ids=lambda c: c.__name__)
def test_steady_state_step_makes_no_tensor_from_a_python_number(cls):
    from torch.profiler import ProfilerActivity, profile

    model = make_model()
    optimizer = cls(model.parameters(), lr=1e-3, backend="compile")
    scheduler = lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
    train_step(model, optimizer)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    graphs = graph_count(optimizer)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            optimizer.step()
            scheduler.step()
    names = [event.name for event in prof.events()]
    assert any("CompiledFunction" in n or "Torch-Compiled" in n for n in names), "the compiled step ran"
    assert [n for n in names if n in FACTORY_OPS] == []
    assert graph_count(optimizer) == graphs


@pytest.mark.cuda
def test_no_host_to_device_copy_per_step_on_cuda():
    model = make_model().cuda()
    optimizer = AdamW4bit(model.parameters(), lr=1e-3)
    scheduler = lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            optimizer.step()
            scheduler.step()
        torch.cuda.synchronize()
    copies = [e.name for e in prof.events() if "HtoD" in e.name or "Memcpy HtoD" in e.name]
    assert copies == []

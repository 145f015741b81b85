"""CPUOffloadOptimizer: the offloaded optimizer steps exactly like the same optimizer
without offload.

Without a GPU the "device" is the CPU: parameters and gradients still travel between distinct
tensors through the real hooks and bookkeeping, so each user pattern below is compared with
the plain optimizer on an identical model, bit for bit. Both get the same gradients from one
place (``Gradients``: computed once, replayed into each model through backward), so equality
tests the optimizers, not the determinism of the model's kernels. The ``cuda`` tests check the
real device path when a GPU is present.
"""

import copy
import importlib.util
import json
import os
import pathlib
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from lowbit_optim import (
    AdamW4bit,
    AdamW8bit,
    AdamWFactored4bit,
    AdamWFp8,
    AdEMAMix4bit,
    CPUOffloadOptimizer,
    FactoredState,
    Lion8bit,
    QuantizedState,
)
from lowbit_optim.offload.gradient import HostGradient

STEPS = 4
# min_quant_size=1024 quantizes both weight matrices of the model below (4096 elements), and
# AdamWFactored4bit factors their second moments (64 + 64 statistics each).
LOWBIT = dict(min_quant_size=1024, backend="eager")
OPTIMIZERS = {
    "AdamW4bit": (AdamW4bit, LOWBIT),
    "AdamW8bit": (AdamW8bit, LOWBIT),
    "AdamWFactored4bit": (AdamWFactored4bit, LOWBIT),
    "AdamWFp8": (AdamWFp8, LOWBIT),
    # Other update rules: the offload is generic over the rule (its moments, its hyperparameters).
    "Lion8bit": (Lion8bit, LOWBIT),
    "AdEMAMix4bit": (AdEMAMix4bit, dict(LOWBIT, t_alpha=5, t_beta3=5)),
    "torch_AdamW": (torch.optim.AdamW, dict(fused=True)),
}
LOWBIT_NAMES = [name for name in OPTIMIZERS if name != "torch_AdamW"]
# The weights' second moment in each format (the first moment is always a QuantizedState).
EXP_AVG_SQ_TYPE = {"AdamWFactored4bit": FactoredState}


def small_model(device="cpu"):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 64),
    ).to(device)


def batch(step, micro=0, device="cpu"):
    generator = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(8, 64, generator=generator).to(device)


def loss(model, step, micro=0):
    return model(batch(step, micro, next(model.parameters()).device)).square().mean()


def backward(model, step, micro=0):
    loss(model, step, micro).backward()


class Gradients:
    """Each (step, micro-batch)'s gradients, computed once by the first model that asks and
    replayed into every model after: the runs compared for equality take their inputs from
    one place instead of recomputing them (equal only while the models are, and only with
    deterministic kernels)."""

    def __init__(self):
        self.recorded = {}

    def backward(self, model, step, micro=0):
        params = [param for param in model.parameters() if param.requires_grad]
        if (step, micro) not in self.recorded:
            self.recorded[step, micro] = torch.autograd.grad(loss(model, step, micro), params)
        # d/dp sum(p * g) is 1.0 * g, so g bit for bit; a real backward, so autograd
        # accumulates and runs the post-accumulate-grad hooks the offload relies on.
        torch.autograd.backward([(param * grad).sum()
                                 for param, grad in zip(params, self.recorded[step, micro], strict=True)])


def twins(name="AdamW4bit", *, model_fn=small_model, groups=None, offload_gradients=False, **extra):
    """The same model twice: one stepped by the plain optimizer, one by the offloaded one."""
    optimizer_class, kwargs = OPTIMIZERS[name]
    kwargs = {"lr": 1e-2, **kwargs, **extra}
    plain_model, offload_model = model_fn(), model_fn()
    params = groups or (lambda model: model.parameters())
    plain = optimizer_class(params(plain_model), **kwargs)
    offloaded = CPUOffloadOptimizer(params(offload_model), optimizer_class,
                                    offload_gradients=offload_gradients, **kwargs)
    return (plain_model, plain), (offload_model, offloaded)


def assert_same_params(model_a, model_b):
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(a, b), name


def assert_same_state(state_dict_a, state_dict_b):
    assert state_dict_a["param_groups"] == state_dict_b["param_groups"]
    assert state_dict_a["state"].keys() == state_dict_b["state"].keys()
    for index, state in state_dict_a["state"].items():
        for key, value in state.items():
            other = state_dict_b["state"][index][key]
            assert type(value) is type(other) and torch.equal(value, other), (index, key)


def train(pairs, steps=range(STEPS), *, clip=None, micro_batches=1, gradients=None):
    """Train each (model, optimizer, scheduler) in turn on ``gradients`` (a new source unless
    given: pass one to several calls whose runs are compared)."""
    gradients = gradients or Gradients()
    for step in steps:
        for model, optimizer, scheduler in pairs:
            for micro in range(micro_batches):
                gradients.backward(model, step, micro)
            if clip == "device":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            elif clip == "helper":
                clipper = optimizer if isinstance(optimizer, CPUOffloadOptimizer) else None
                if clipper is None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                else:
                    clipper.clip_grad_norm_(0.05)
            optimizer.step()
            optimizer.zero_grad()
            if scheduler is not None:
                scheduler.step()


# --- the training loop ------------------------------------------------------------------
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_training_loop_with_scheduler_matches_the_optimizer_without_offload(name):
    (plain_model, plain), (offload_model, offloaded) = twins(name)
    pairs = [(model, optimizer, torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.02, total_steps=10))
             for model, optimizer in ((plain_model, plain), (offload_model, offloaded))]
    train(pairs)
    assert_same_params(plain_model, offload_model)
    assert_same_state(plain.state_dict(), offloaded.state_dict())
    # The scheduler wrote into the host optimizer's groups, the ones the host step reads.
    assert offloaded.param_groups is offloaded.host_optimizer.param_groups
    assert float(offloaded.param_groups[0]["lr"]) == float(plain.param_groups[0]["lr"])


@pytest.mark.parametrize("name", LOWBIT_NAMES)
def test_state_lives_on_the_host_in_our_formats(name):
    _, (model, offloaded) = twins(name)
    train([(model, offloaded, None)], range(1))
    weight = model[0].weight
    host = offloaded.host_param(weight)
    assert host is not weight and host.data_ptr() != weight.data_ptr()
    state = offloaded.state[host]
    keys = offloaded.host_optimizer.rule.moment_keys(offloaded.param_groups[0])
    assert type(state["exp_avg"]) is QuantizedState
    if "exp_avg_sq" in keys:
        assert type(state["exp_avg_sq"]) is EXP_AVG_SQ_TYPE.get(name, QuantizedState)
    for key in keys:  # the wrapper's device and every tensor it holds
        inner_names, _ = state[key].__tensor_flatten__()
        assert {getattr(state[key], inner).device.type for inner in inner_names} == {"cpu"}, key
    assert weight not in offloaded.state


@pytest.mark.parametrize("name", LOWBIT_NAMES)
def test_param_groups_with_their_own_hyperparameters(name):
    def groups(model):
        # The last group's min_quant_size keeps its weight's moments in float32 (and so
        # unfactored): one optimizer holding both kinds of state.
        return [{"params": list(model[0].parameters()), "lr": 3e-2, "weight_decay": 0.0},
                {"params": list(model[2].parameters()) + list(model[3].parameters()),
                 "min_quant_size": 8192}]

    (plain_model, plain), (offload_model, offloaded) = twins(name, groups=groups)
    train([(plain_model, plain, None), (offload_model, offloaded, None)])
    assert_same_params(plain_model, offload_model)
    decays = [group["weight_decay"] for group in offloaded.param_groups]
    assert decays == [0.0, offloaded.defaults["weight_decay"]]
    assert_same_state(plain.state_dict(), offloaded.state_dict())
    last_weight = offloaded.state[offloaded.host_param(offload_model[3].weight)]
    assert all(type(last_weight[key]) is torch.Tensor
               for key in offloaded.host_optimizer.rule.moment_keys(offloaded.param_groups[1]))


def test_add_param_group_and_step_hooks():
    (plain_model, plain), (offload_model, offloaded) = twins(
        "AdamW8bit", groups=lambda model: list(model[0].parameters()))
    steps_seen = []
    offloaded.register_step_post_hook(lambda optimizer, args, kwargs: steps_seen.append(optimizer))
    for model, optimizer in ((plain_model, plain), (offload_model, offloaded)):
        optimizer.add_param_group({"params": list(model[3].parameters()), "lr": 5e-3})
    train([(plain_model, plain, None), (offload_model, offloaded, None)])
    assert_same_params(plain_model, offload_model)
    assert steps_seen == [offloaded] * STEPS
    assert offloaded.param_groups[1]["params"][0] is offloaded.host_param(offload_model[3].weight)


@pytest.mark.parametrize("clip", ["device", "helper"])
def test_gradient_clipping(clip):
    # "device": torch.nn.utils.clip_grad_norm_(model.parameters()) after the hooks copied the
    # gradients (the version counters send the clipped ones again); "helper": the optimizer's.
    (plain_model, plain), (offload_model, offloaded) = twins("AdamW4bit")
    train([(plain_model, plain, None), (offload_model, offloaded, None)], clip=clip)
    assert_same_params(plain_model, offload_model)


@pytest.mark.parametrize("offload_gradients", [False, True], ids=["grads_on_device", "offload_gradients"])
def test_gradient_accumulation_over_micro_batches(offload_gradients):
    (plain_model, plain), (offload_model, offloaded) = twins(
        "AdamW4bit", offload_gradients=offload_gradients)
    train([(plain_model, plain, None), (offload_model, offloaded, None)], micro_batches=3,
          clip="helper" if offload_gradients else "device")
    assert_same_params(plain_model, offload_model)


def test_offload_gradients_frees_device_gradients_as_backward_goes():
    (plain_model, plain), (offload_model, offloaded) = twins("AdamW8bit", offload_gradients=True)
    freed_during_backward = []
    last_layer = offload_model[3].weight
    # The first layer's gradient comes last: by then the last layer's must be gone already.
    offload_model[0].weight.register_post_accumulate_grad_hook(
        lambda param: freed_during_backward.append(type(last_layer.grad) is HostGradient))
    backward(offload_model, 0)
    assert freed_during_backward == [True]
    # What is left on each parameter has its metadata and no storage to hold a gradient.
    assert all(type(param.grad) is HostGradient and param.grad.shape == param.shape
               for param in offload_model.parameters())
    offloaded.step()
    backward(plain_model, 0)
    plain.step()
    assert_same_params(plain_model, offload_model)


def test_torch_clip_grad_norm_on_the_model_clips_offloaded_gradients():
    """A training loop written for the device calls ``torch.nn.utils.clip_grad_norm_`` on the
    model: with ``offload_gradients=True`` it returned 0.0 and clipped nothing. It now returns
    the optimizer's own ``clip_grad_norm_`` result and trains identically, micro-batches too."""
    _, (helper_model, helper) = twins("AdamW4bit", offload_gradients=True)
    _, (torch_model, torch_clipped) = twins("AdamW4bit", offload_gradients=True)
    gradients = Gradients()
    for step in range(STEPS):
        for model in (helper_model, torch_model):
            for micro in range(2):
                gradients.backward(model, step, micro)
        expected = helper.clip_grad_norm_(0.05)
        total_norm = torch.nn.utils.clip_grad_norm_(torch_model.parameters(), 0.05)
        assert expected > 0.05 and torch.equal(total_norm, expected), (total_norm, expected)
        for optimizer in (helper, torch_clipped):
            optimizer.step()
            optimizer.zero_grad()
    assert_same_params(helper_model, torch_model)


def test_offloaded_gradient_refuses_other_operations_by_name():
    _, (model, _) = twins("AdamW8bit", offload_gradients=True)
    backward(model, 0)
    with pytest.raises(RuntimeError, match="optimizer.clip_grad_norm_"):
        model[0].weight.grad.sum()


def test_model_zero_grad_after_step_starts_a_new_host_gradient():
    """Hugging Face ``Trainer``'s loop: ``optimizer.step()`` then ``model.zero_grad()`` (never the
    optimizer's). The host gradient must restart at the next backward, not add to the last."""
    (plain_model, plain), (offload_model, offloaded) = twins("AdamW8bit", offload_gradients=True)
    gradients = Gradients()
    for step in range(STEPS):
        for model, optimizer in ((plain_model, plain), (offload_model, offloaded)):
            gradients.backward(model, step)
            optimizer.step()
            model.zero_grad()
    assert_same_params(plain_model, offload_model)


def test_frozen_parameters_are_skipped():
    def frozen_first_layer():
        model = small_model()
        model[0].requires_grad_(False)
        return model

    (plain_model, plain), (offload_model, offloaded) = twins("AdamW4bit", model_fn=frozen_first_layer)
    train([(plain_model, plain, None), (offload_model, offloaded, None)])
    assert_same_params(plain_model, offload_model)
    assert len(offloaded.param_groups[0]["params"]) == 4  # no host copy of the frozen two
    # Numbered as the parameters given, frozen ones included: the plain optimizer's numbers.
    assert_same_state(plain.state_dict(), offloaded.state_dict())


def test_named_parameters_with_a_frozen_one():
    def frozen_first_bias():
        model = small_model()
        model[0].bias.requires_grad_(False)
        return model

    (plain_model, plain), (offload_model, offloaded) = twins(
        "AdamW4bit", model_fn=frozen_first_bias, groups=lambda model: model.named_parameters())
    train([(plain_model, plain, None), (offload_model, offloaded, None)])
    assert_same_params(plain_model, offload_model)
    assert "0.bias" not in offloaded.param_groups[0]["param_names"]
    saved = offloaded.state_dict()
    assert_same_state(plain.state_dict(), saved)  # param_names included, frozen one too
    plain.load_state_dict(saved)
    offloaded.load_state_dict(saved)
    assert_same_state(plain.state_dict(), offloaded.state_dict())


def test_zero_grad_without_set_to_none_and_hand_set_gradients():
    (plain_model, plain), (offload_model, offloaded) = twins("AdamW8bit")
    gradients = Gradients()
    for model, optimizer in ((plain_model, plain), (offload_model, offloaded)):
        gradients.backward(model, 0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        gradients.backward(model, 1)
        model[3].bias.grad = torch.full_like(model[3].bias, 0.5)  # no hook sees this one
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        optimizer.step()  # zero gradients still step: momentum and weight decay
    assert_same_params(plain_model, offload_model)


def test_device_weights_loaded_after_the_optimizer_was_built():
    (plain_model, plain), (offload_model, offloaded) = twins("AdamW8bit")
    weights = {key: value + 0.5 for key, value in small_model().state_dict().items()}
    gradients = Gradients()
    for model, optimizer in ((plain_model, plain), (offload_model, offloaded)):
        model.load_state_dict(weights)
        train([(model, optimizer, None)], range(2), gradients=gradients)
    assert_same_params(plain_model, offload_model)


# --- checkpoints ------------------------------------------------------------------------
@pytest.mark.sweep
@pytest.mark.parametrize("name", LOWBIT_NAMES)
@pytest.mark.parametrize("route", ["offloaded_to_offloaded", "offloaded_to_plain", "plain_to_offloaded"])
def test_resume_from_a_checkpoint_is_bit_exact(route, name):
    optimizer_class, kwargs = OPTIMIZERS[name]
    (reference_model, reference), (model, optimizer) = twins(name)
    gradients = Gradients()
    train([(reference_model, reference, None)], gradients=gradients)  # uninterrupted
    if route.startswith("offloaded"):
        first = optimizer
    else:
        first = optimizer_class(model.parameters(), lr=1e-2, **kwargs)
    train([(model, first, None)], range(STEPS // 2), gradients=gradients)
    saved_weights, saved_state = copy.deepcopy(model.state_dict()), copy.deepcopy(first.state_dict())

    resumed_model = small_model()
    resumed_model.load_state_dict(saved_weights)
    if route.endswith("to_plain"):
        resumed = optimizer_class(resumed_model.parameters(), lr=1e-2, **kwargs)
    else:
        resumed = CPUOffloadOptimizer(resumed_model.parameters(), optimizer_class, lr=1e-2, **kwargs)
    resumed.load_state_dict(saved_state)
    train([(resumed_model, resumed, None)], range(STEPS // 2, STEPS), gradients=gradients)
    assert_same_params(reference_model, resumed_model)
    assert_same_state(reference.state_dict(), resumed.state_dict())


@pytest.mark.parametrize("name", [name for name in LOWBIT_NAMES if OPTIMIZERS[name][0].rule.name == "adamw"])
def test_torch_adamw_checkpoints_convert_both_ways(name):
    from lowbit_optim.checkpoint import to_torch_adamw

    torch_model, offload_model = small_model(), small_model()
    torch_adamw = torch.optim.AdamW(torch_model.parameters(), lr=1e-2)
    offloaded = CPUOffloadOptimizer(offload_model.parameters(), OPTIMIZERS[name][0], lr=1e-2, **LOWBIT)
    train([(torch_model, torch_adamw, None), (offload_model, offloaded, None)], range(2))
    offloaded.load_state_dict(torch_adamw.state_dict())  # fp32 moments quantized on the way in
    state = offloaded.state[offloaded.host_param(offload_model[0].weight)]
    assert type(state["exp_avg"]) is QuantizedState
    assert type(state["exp_avg_sq"]) is EXP_AVG_SQ_TYPE.get(name, QuantizedState)
    torch_adamw.load_state_dict(to_torch_adamw(offloaded.state_dict()))
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch_adamw.state[torch_model[0].weight][key].dtype == torch.float32, key


def test_state_dict_hooks_run():
    _, (_, offloaded) = twins("AdamW8bit")
    calls = []
    offloaded.register_state_dict_post_hook(lambda optimizer, state_dict: calls.append("saved"))
    offloaded.register_load_state_dict_post_hook(lambda optimizer: calls.append("loaded"))
    offloaded.load_state_dict(offloaded.state_dict())
    assert calls == ["saved", "loaded"]


def test_a_state_dict_that_does_not_fit_is_refused():
    _, (_, offloaded) = twins("AdamW8bit")
    saved = offloaded.state_dict()
    saved["param_groups"][0]["params"].pop()
    with pytest.raises(ValueError, match="doesn't match the size"):
        offloaded.load_state_dict(saved)


# --- construction -----------------------------------------------------------------------
def test_construction_errors_are_clear():
    model = small_model()
    with pytest.raises(TypeError, match="minimal_size"):
        CPUOffloadOptimizer(model.parameters(), AdamW8bit, minimal_size=4096)
    with pytest.raises(ValueError, match="more than one parameter group"):
        CPUOffloadOptimizer([{"params": model[0].parameters()}, {"params": model[0].parameters()}])
    with pytest.raises(ValueError, match="Invalid learning rate"):
        CPUOffloadOptimizer(model.parameters(), AdamW8bit, lr=-1.0)


def test_hooks_do_not_keep_a_dropped_optimizer_alive():
    model = small_model()
    optimizer = CPUOffloadOptimizer(model.parameters(), AdamW8bit, offload_gradients=True)
    del optimizer
    backward(model, 0)  # the removed hooks neither copy nor free
    assert all(param.grad is not None for param in model.parameters())


# --- Hugging Face Trainer ---------------------------------------------------------------
# Slow tier: Trainer runs (tests/test_huggingface.py keeps one in the fast tier).
@pytest.fixture(scope="module")
def trained_gpt2(tmp_path_factory):
    """``trained_gpt2(optim, optim_args)``: a 3-step Trainer run of a tiny GPT-2 with clipping
    (max_grad_norm=0.5) and 2 micro-batches, run once per module and shared."""
    runs = {}

    def run(optim, optim_args=""):
        if (optim, optim_args) not in runs:
            runs[optim, optim_args] = _train_gpt2(tmp_path_factory.mktemp(optim), optim, optim_args)
        return runs[optim, optim_args]

    return run


def _train_gpt2(tmp_path, optim, optim_args):
    transformers = pytest.importorskip("transformers")
    from lowbit_optim.integrations.transformers import register

    register()
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1,
                                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    rows = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(0))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / optim), optim=optim, max_steps=3, learning_rate=3e-3,
        per_device_train_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=0.5,
        lr_scheduler_type="cosine", optim_args="min_quant_size=1024,backend=eager" + optim_args,
        report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
        logging_steps=1)
    trainer = transformers.Trainer(model=model, args=args,
                                   train_dataset=[{"input_ids": r, "labels": r} for r in rows])
    trainer.train()
    return trainer


def logged_grad_norms(trainer):
    return [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]


@pytest.mark.slow
def test_trainer_with_the_offload_optim_name_matches_the_plain_one(trained_gpt2):
    pytest.importorskip("accelerate")
    plain = trained_gpt2("lowbit_adamw_8bit")
    offloaded = trained_gpt2("lowbit_adamw_8bit_offload")
    inner = offloaded.optimizer.optimizer  # accelerate's wrapper around ours
    assert type(inner) is CPUOffloadOptimizer and type(inner.host_optimizer) is AdamW8bit
    assert len(inner.param_groups) == 2  # Trainer's decay / no-decay groups
    assert_same_params(plain.model, offloaded.model)


@pytest.mark.slow
def test_trainer_with_offload_gradients_and_max_grad_norm_clips_like_without_offload(trained_gpt2):
    """Trainer clips through accelerate and ``torch.nn.utils.clip_grad_norm_(model.parameters())``,
    then calls ``model.zero_grad()``: with offload_gradients=true that clipped nothing before
    (so it was refused). Same weights and logged gradient norms as the plain optimizer."""
    pytest.importorskip("accelerate")
    plain = trained_gpt2("lowbit_adamw_8bit")
    offloaded = trained_gpt2("lowbit_adamw_8bit_offload", ",offload_gradients=true")
    assert offloaded.optimizer.optimizer.offload_gradients
    norms = logged_grad_norms(plain)
    assert len(norms) == 3 and min(norms) > 0.5  # every step was clipped
    assert logged_grad_norms(offloaded) == norms
    assert_same_params(plain.model, offloaded.model)


# --- FSDP2's own CPU offload -------------------------------------------------------------
FSDP2_CPU_OFFLOAD = textwrap.dedent("""
    import gc, os, torch, torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from lowbit_optim import AdamW4bit
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"], RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    sharded, plain = model(), model()
    policy = CPUOffloadPolicy(pin_memory=False)  # pinning needs an accelerator
    for module in (sharded[0], sharded[2], sharded):
        fully_shard(module, offload_policy=policy)
    optimizers = [AdamW4bit(m.parameters(), lr=1e-2, min_quant_size=1024, backend="eager")
                  for m in (sharded, plain)]
    for step in range(3):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
        for m, optimizer in zip((sharded, plain), optimizers):
            m(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    for a, b in zip(sharded.parameters(), plain.parameters()):
        assert torch.equal(a.full_tensor(), b)
    # FSDP2's modules hold gloo work: freed after the group is torn down (at exit) they can
    # abort the process (pytorch/pytorch#179291), so they go first.
    del sharded, optimizers, a, b
    gc.collect()
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_fsdp2_cpu_offload_policy_with_our_optimizer():
    # A process of its own: the process group must not leak into other tests.
    env = {**os.environ, "PORT": str(random.randint(20000, 40000))}
    subprocess.run([sys.executable, "-c", FSDP2_CPU_OFFLOAD], check=True, env=env, timeout=120)


# --- the GPU check's overlap measure ----------------------------------------------------------
def test_gpu_check_reads_copy_overlap_from_a_profiler_trace(tmp_path):
    path = pathlib.Path(__file__).parent.parent / "benchmarks" / "gpu_offload_check.py"
    spec = importlib.util.spec_from_file_location("gpu_offload_check", path)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": [
        {"cat": "kernel", "name": "gemm", "ts": 0, "dur": 10},
        {"cat": "kernel", "name": "gemm", "ts": 5, "dur": 10},  # overlapping kernels count once
        {"cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 10, "dur": 10},
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 0, "dur": 30},
    ]}))
    assert check.copy_overlap(trace) == 0.5


# --- the real device path ---------------------------------------------------------------
def exact_gradient_model(device):
    """loss = sum(weight * c): the gradient is exactly c on any device, so the host step sees
    the same bits as a CPU run and the results can be compared exactly."""
    torch.manual_seed(0)
    return torch.nn.ParameterList([torch.nn.Parameter(torch.randn(128, 96)),
                                   torch.nn.Parameter(torch.randn(96))]).to(device)


def exact_backward(params, step):
    for index, param in enumerate(params):
        coefficient = torch.randn(param.shape, generator=torch.Generator().manual_seed(10 * step + index))
        (param * coefficient.to(param.device)).sum().backward()


@pytest.mark.cuda
@pytest.mark.parametrize("name", LOWBIT_NAMES)
@pytest.mark.parametrize("offload_gradients", [False, True], ids=["grads_on_device", "offload_gradients"])
def test_cuda_training_matches_the_cpu_offload_bit_for_bit(offload_gradients, name):
    runs = {}
    for device in ("cuda", "cpu"):
        params = exact_gradient_model(device)
        optimizer = CPUOffloadOptimizer(params, OPTIMIZERS[name][0], offload_gradients=offload_gradients,
                                        lr=1e-2, **LOWBIT)
        for step in range(STEPS):
            exact_backward(params, step)
            exact_backward(params, step + 100)  # a second micro-batch
            if offload_gradients:
                assert all(param.grad is None for param in params)
            optimizer.step()
            optimizer.zero_grad()
        runs[device] = [param.detach().cpu() for param in params]
    for cuda_param, cpu_param in zip(runs["cuda"], runs["cpu"]):
        assert torch.equal(cuda_param, cpu_param)


@pytest.mark.cuda
def test_cuda_state_and_buffers_stay_off_the_device():
    params = exact_gradient_model("cuda")
    before = torch.cuda.memory_allocated()
    optimizer = CPUOffloadOptimizer(params, AdamW8bit, lr=1e-2, **LOWBIT)
    exact_backward(params, 0)
    optimizer.step()
    torch.cuda.synchronize()
    gradients = sum(param.grad.nbytes for param in params)
    assert torch.cuda.memory_allocated() - before <= gradients + 4096
    host = optimizer.host_param(params[0])
    assert host.is_pinned() and optimizer.state[host]["exp_avg"].device.type == "cpu"

"""Hugging Face Trainer with ``optim="lowbit_muon_8bit"`` / ``"lowbit_muon_4bit"``: the handler
splits the model itself (Muon for the hidden matrices, the low-bit AdamW for embeddings, the
tied head, norms and biases), keeps Trainer's weight decay rule, and gives both parts the one
learning rate with ``adjust_lr_fn="match_rms_adamw"``. A real Trainer on the tiny GPT-2 of
tests/test_huggingface.py, a few steps on the eager backend."""

import math

import pytest
import torch
from conftest import num_threads, slow_except

transformers = pytest.importorskip("transformers")

from test_huggingface import byte_dataset, inner, step_logs, tiny_gpt2, training_args  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from lowbit_optim import CPUOffloadOptimizer, Muon4bit, QuantizedState  # noqa: E402
from lowbit_optim.integrations.transformers import (  # noqa: E402
    MUON_OFFLOAD_OPTIMIZERS,
    MUON_OPTIMIZERS,
    register,
)

STEPS = 3


@pytest.fixture(scope="module", autouse=True)
def registered():
    return register()


@pytest.fixture(autouse=True)
def _one_thread():
    """Newton-Schulz's bf16 matmuls on small matrices are much slower on two threads than on one
    on a shared 2-core machine (tests/test_muon.py): one thread keeps the file fast."""
    with num_threads(1):
        yield


def hidden_matrix_names(model) -> set[str]:
    """GPT-2's attention and MLP matrices (Conv1D weights): what Muon is for."""
    return {name for name, param in model.named_parameters() if param.ndim == 2 and ".h." in name}


def train_with(tmp_path, optim: str) -> Trainer:
    args = training_args(tmp_path / optim, optim=optim, optim_args="backend=eager", max_steps=STEPS,
                         gradient_accumulation_steps=1, save_strategy="no", warmup_steps=0)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=byte_dataset(40))
    trainer.train()
    return trainer


@pytest.mark.parametrize("optim", slow_except([*MUON_OPTIMIZERS, *MUON_OFFLOAD_OPTIMIZERS],
                                              "lowbit_muon_8bit"))
def test_trainer_with_a_muon_string_splits_the_model_and_trains(tmp_path, optim):
    trainer = train_with(tmp_path, optim)
    optimizer = inner(trainer.optimizer)
    if optim in MUON_OFFLOAD_OPTIMIZERS:  # the same class, stepped on the host: the same result
        assert type(optimizer) is CPUOffloadOptimizer
        plain = train_with(tmp_path, optim.removesuffix("_offload"))
        for (name, expected), actual in zip(plain.model.named_parameters(), trainer.model.parameters()):
            assert torch.equal(actual, expected), name
        optimizer = optimizer.host_optimizer
    assert type(optimizer) is {**MUON_OPTIMIZERS, **MUON_OFFLOAD_OPTIMIZERS}[optim]
    model = trainer.model
    # What the optimizer keys its groups and state by: an offloaded parameter's host copy.
    host = getattr(inner(trainer.optimizer), "host_param", lambda param: param)
    names = {id(host(param)): name for name, param in model.named_parameters()}  # lm_head is wte
    by_rule = {use_muon: {names[id(p)] for group in optimizer.param_groups if group["use_muon"] == use_muon
                          for p in group["params"]} for use_muon in (True, False)}
    muon, adamw = by_rule[True], by_rule[False]
    assert muon == hidden_matrix_names(model)
    assert adamw == set(names.values()) - muon
    assert {"transformer.wte.weight", "transformer.wpe.weight"} <= adamw
    # Trainer's weight decay rule: none on biases and norms, the rest decays (Muon's matrices too).
    decay_names = set(trainer.get_decay_parameter_names(model))
    for group in optimizer.param_groups:
        expected = 0.1 if names[id(group["params"][0])] in decay_names else 0.0
        assert group["weight_decay"] == expected
        assert all((names[id(p)] in decay_names) == bool(expected) for p in group["params"])
        if group["use_muon"]:
            assert group["adjust_lr_fn"] == "match_rms_adamw"
    # One schedule, one LR for both parts (the same float in every group at every step).
    assert len({group["lr"] for group in optimizer.param_groups}) == 1
    for param in model.parameters():
        state = optimizer.state[host(param)]
        assert int(state["step"]) == STEPS
        if names[id(host(param))] in muon:
            assert set(state) == {"step", "momentum_buffer"}
            assert isinstance(state["momentum_buffer"], QuantizedState) == (param.numel() >= 4096)
        else:
            assert "exp_avg" in state and "momentum_buffer" not in state
    losses = [entry["loss"] for entry in step_logs(trainer)]
    assert len(losses) == STEPS and all(math.isfinite(loss) for loss in losses)


def test_muon_optim_args_are_torch_muons_and_the_storage_options(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), optim="lowbit_muon_4bit", report_to="none",
                             use_cpu=True, learning_rate=2e-3, adam_beta1=0.8, adam_epsilon=1e-7,
                             weight_decay=0.05,
                             optim_args="momentum=0.9,nesterov=false,ns_steps=3,adjust_lr_fn=original,"
                                        "block_size=64,backend=eager")
    model = tiny_gpt2()
    optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    assert optimizer_cls is Muon4bit
    groups = kwargs.pop("params")
    assert kwargs == dict(lr=2e-3, weight_decay=0.05, adjust_lr_fn="original", adamw_betas=(0.8, 0.999),
                          adamw_eps=1e-7, momentum=0.9, nesterov=False, ns_steps=3, block_size=64,
                          backend="eager")
    assert sum(len(group["params"]) for group in groups) == len(list(model.parameters()))
    optimizer = optimizer_cls(groups, **kwargs)
    muon_group = next(group for group in optimizer.param_groups if group["use_muon"])
    assert (muon_group["momentum"], muon_group["nesterov"], muon_group["ns_steps"]) == (0.9, False, 3)
    adamw_group = next(group for group in optimizer.param_groups if not group["use_muon"])
    assert adamw_group["betas"] == (0.8, 0.999) and adamw_group["eps"] == 1e-7


@pytest.mark.parametrize("optim_args, message", [
    ("amsgrad=true", "Unknown optim_args key 'amsgrad' for optim='lowbit_muon_8bit'"),
    ("ns_steps=five", "Invalid optim_args value ns_steps='five'.*an int"),
])
def test_bad_muon_optim_args_name_the_culprit(tmp_path, optim_args, message):
    args = TrainingArguments(output_dir=str(tmp_path), optim="lowbit_muon_8bit", optim_args=optim_args,
                             report_to="none", use_cpu=True)
    with pytest.raises(ValueError, match=message):
        Trainer.get_optimizer_cls_and_kwargs(args, tiny_gpt2())


def test_muon_string_without_the_model_is_refused_naming_why(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), optim="lowbit_muon_8bit", report_to="none",
                             use_cpu=True)
    with pytest.raises(ValueError, match="optim='lowbit_muon_8bit' splits the model's parameters.*needs the"):
        Trainer.get_optimizer_cls_and_kwargs(args)


def test_muon_split_leaves_out_frozen_parameters(tmp_path):
    """As Trainer's own groups: a parameter that does not require gradients is not stepped."""
    model = tiny_gpt2()
    model.transformer.wpe.weight.requires_grad_(False)
    model.transformer.h[0].attn.c_attn.weight.requires_grad_(False)
    args = TrainingArguments(output_dir=str(tmp_path), optim="lowbit_muon_8bit", report_to="none",
                             use_cpu=True)
    _, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    stepped = {id(p) for group in kwargs["params"] for p in group["params"]}
    assert stepped == {id(p) for p in model.parameters() if p.requires_grad}
    assert torch.is_tensor(next(iter(kwargs["params"]))["params"][0])

"""Hugging Face Trainer integration: optim names, optim_args, a real Trainer run, resume.

One 20-step 4-bit Trainer run (compiled) and its resumption from step 10 are shared by the
tests through module-scoped fixtures; the other routes run 2-4 steps each on the eager backend
(except the accelerate check's 4-bit optimizer, which reuses the compiled graph), so that the
file compiles one graph only.
"""

import copy
import math
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import slow_except

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from torch._dynamo.utils import counters  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    HfArgumentParser,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    trainer_optimizer,
)
from transformers import trainer as hf_trainer  # noqa: E402
from transformers.training_args import OptimizerNames  # noqa: E402

from lowbit_optim import (  # noqa: E402
    AdamW4bit,
    AdamW8bit,
    AdamWFactored4bit,
    CPUOffloadOptimizer,
    FactoredState,
    QuantizedState,
    master_weights_state_dict,
)
from lowbit_optim.integrations.transformers import (  # noqa: E402
    MUON_OFFLOAD_OPTIMIZERS,
    MUON_OPTIMIZERS,
    OFFLOAD_OPTIMIZERS,
    OPTIMIZERS,
    register,
)
from lowbit_optim.step.dispatch import resolve_backend  # noqa: E402
from lowbit_optim.step.master_weights import CORRECTION_KEY  # noqa: E402

SEQ_LEN = 64
STEPS, SAVE_AT, ACCUMULATION, MAX_GRAD_NORM = 20, 10, 2, 2.0
# Every registered optim name -> (the class Trainer builds, the kwargs our handler adds for it).
BUILDS = {
    **{name: (cls, {}) for name, cls in OPTIMIZERS.items()},
    **{name: (CPUOffloadOptimizer, {"optimizer_class": cls}) for name, cls in OFFLOAD_OPTIMIZERS.items()},
    # tests/test_huggingface_muon.py
    **{name: (cls, {}) for name, cls in MUON_OPTIMIZERS.items()},
    **{name: (CPUOffloadOptimizer, {"optimizer_class": c}) for name, c in MUON_OFFLOAD_OPTIMIZERS.items()},
}


@pytest.fixture(scope="module", autouse=True)
def registered():
    return register()


def tiny_gpt2(seed=0):
    """2 layers, width 64, bytes as tokens: 136k parameters, 6 matrices of >= 4096 elements."""
    config = GPT2Config(
        vocab_size=256, n_positions=SEQ_LEN, n_embd=64, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)


def byte_dataset(rows=200):
    """Rows of stdlib source text as bytes (no downloads; real text, so the loss can fall)."""
    text = pathlib.Path(textwrap.__file__).read_bytes()
    assert len(text) >= rows * SEQ_LEN
    data = torch.tensor(list(text[: rows * SEQ_LEN]), dtype=torch.long).view(rows, SEQ_LEN)
    return [{"input_ids": row, "labels": row} for row in data]


def training_args(output_dir, **overrides):
    settings = dict(
        output_dir=str(output_dir), max_steps=STEPS, per_device_train_batch_size=4,
        gradient_accumulation_steps=ACCUMULATION, learning_rate=3e-3, warmup_steps=4,
        lr_scheduler_type="cosine", weight_decay=0.1, max_grad_norm=MAX_GRAD_NORM,
        logging_steps=1, save_steps=SAVE_AT, report_to="none", use_cpu=True, seed=0,
        disable_tqdm=True,
    )
    settings.update(overrides)
    return TrainingArguments(**settings)


def inner(optimizer):
    """Trainer wraps the optimizer in accelerate's AcceleratedOptimizer."""
    return getattr(optimizer, "optimizer", optimizer)


class Recorder(TrainerCallback):
    """What each optimizer step saw: LR tensors, post-clipping grad norm, compiled graphs."""

    def __init__(self):
        self.lrs, self.lr_ids, self.clipped_norms, self.graphs_after_step = [], [], [], []
        self.substeps = 0

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        groups = inner(optimizer).param_groups
        self.lrs.append([group["lr"] for group in groups])
        self.lr_ids.append([id(cache.scalars.lr) for cache in inner(optimizer)._caches])
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        self.clipped_norms.append(float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g) for g in grads]))))

    def on_substep_end(self, args, state, control, **kwargs):
        self.substeps += 1

    def on_step_end(self, args, state, control, **kwargs):
        self.graphs_after_step.append(counters["stats"]["unique_graphs"])


def train(args, *, resume_from_checkpoint=None, **trainer_kwargs):
    recorder = Recorder()
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=byte_dataset(),
                      callbacks=[recorder], **trainer_kwargs)
    graphs_before = counters["stats"]["unique_graphs"]
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    return trainer, recorder, graphs_before


# The tests that read the 20-step compiled run and its resumption are in the slow tier.
@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    args = training_args(tmp_path_factory.mktemp("full"), optim="lowbit_adamw_4bit",
                         optim_args="block_size=128,min_quant_size=4096")
    return train(args)


@pytest.fixture(scope="module")
def resumed_run(full_run, tmp_path_factory):
    trainer, _, _ = full_run
    checkpoint = pathlib.Path(trainer.args.output_dir) / f"checkpoint-{SAVE_AT}"
    args = training_args(tmp_path_factory.mktemp("resumed"), optim="lowbit_adamw_4bit",
                         optim_args="block_size=128,min_quant_size=4096")
    return train(args, resume_from_checkpoint=str(checkpoint))


def step_logs(trainer):
    return [entry for entry in trainer.state.log_history if "loss" in entry]


# --- registration ---------------------------------------------------------------------------
def test_register_is_idempotent_and_adds_real_enum_members():
    members_before = list(OptimizerNames)
    handlers = trainer_optimizer._OPTIMIZER_HANDLERS
    handlers_before = dict(handlers)
    assert register() == tuple(OPTIMIZERS)
    assert list(OptimizerNames) == members_before
    assert handlers == handlers_before
    for name in BUILDS:
        member = OptimizerNames(name)
        assert member.value == name and member is OptimizerNames[name.upper()]
        assert member is getattr(OptimizerNames, name.upper())
        assert handlers[member] is hf_trainer._OPTIMIZER_HANDLERS[member]


def test_every_registered_name_is_in_the_docs():
    """docs/huggingface.md's tables list exactly the optim names that register() adds."""
    page = pathlib.Path(__file__).resolve().parent.parent / "docs" / "huggingface.md"
    documented = set(re.findall(r"^\| `(lowbit_\w+)`", page.read_text(), flags=re.MULTILINE))
    registered = {member.value for member in OptimizerNames if member.value.startswith("lowbit_")}
    assert documented == registered == set(BUILDS)


@pytest.mark.slow
def test_import_does_not_import_transformers():
    code = ("import sys, lowbit_optim.integrations.transformers; "
            "assert 'transformers' not in sys.modules, 'imported transformers'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unsupported_transformers_fails_clearly(monkeypatch):
    # Simulates a transformers without the handler table (before huggingface/transformers#43738).
    monkeypatch.delattr(trainer_optimizer, "_OPTIMIZER_HANDLERS")
    with pytest.raises(RuntimeError, match="cannot work with transformers .*optimizer_cls_and_kwargs"):
        register()


def rule_of(name: str) -> str:
    cls, handler_kwargs = BUILDS[name]
    return handler_kwargs.get("optimizer_class", cls).rule.name


@pytest.mark.parametrize("name", [name for name in BUILDS if rule_of(name) == "adamw"])
def test_training_arguments_accept_names_and_type_optim_args(tmp_path, name):
    args = TrainingArguments(
        output_dir=str(tmp_path), optim=name, report_to="none", use_cpu=True,
        learning_rate=2e-3, adam_beta1=0.8, adam_epsilon=1e-7, weight_decay=0.05,
        optim_args=("block_size=128, min_quant_size=4096,bf16_stochastic_round=True,"
                    "amsgrad=false,backend=eager"),
    )
    assert args.to_dict()["optim"] == name
    optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    expected_cls, handler_kwargs = BUILDS[name]
    assert optimizer_cls is expected_cls
    assert kwargs == dict(lr=2e-3, betas=(0.8, 0.999), eps=1e-7, weight_decay=0.05, block_size=128,
                          min_quant_size=4096, bf16_stochastic_round=True, amsgrad=False, backend="eager",
                          **handler_kwargs)


@pytest.mark.parametrize("name", [name for name in BUILDS if rule_of(name) in ("lion", "ademamix")])
def test_lion_and_ademamix_names_take_their_rules_arguments(tmp_path, name):
    """As transformers' own bitsandbytes Lion and AdEMAMix names: Lion takes adam_beta1/2 as its
    betas and no eps; AdEMAMix a third beta, alpha and the warm-up lengths from optim_args."""
    ademamix = rule_of(name) == "ademamix"
    extra = ",beta3=0.999,alpha=8,t_alpha=100,t_beta3=200" if ademamix else ""
    args = TrainingArguments(
        output_dir=str(tmp_path), optim=name, report_to="none", use_cpu=True, learning_rate=2e-4,
        adam_beta1=0.8, adam_epsilon=1e-7, weight_decay=0.05,
        optim_args="block_size=128,master_weight_bits=24,backend=eager" + extra)
    optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    expected_cls, handler_kwargs = BUILDS[name]
    assert optimizer_cls is expected_cls
    rule_kwargs = (dict(betas=(0.8, 0.999, 0.999), eps=1e-7, alpha=8.0, t_alpha=100, t_beta3=200)
                   if ademamix else dict(betas=(0.8, 0.999)))
    assert kwargs == dict(lr=2e-4, weight_decay=0.05, block_size=128, master_weight_bits=24, backend="eager",
                          **rule_kwargs, **handler_kwargs)
    optimizer = optimizer_cls(tiny_gpt2().bfloat16().parameters(), **kwargs)
    assert getattr(optimizer, "host_optimizer", optimizer).defaults["master_weight_bits"] == 24


def test_amsgrad_is_an_adamw_option_only(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), optim="lowbit_lion_8bit", optim_args="amsgrad=true",
                             report_to="none", use_cpu=True)
    with pytest.raises(ValueError, match="Unknown optim_args key 'amsgrad' for optim='lowbit_lion_8bit'"):
        Trainer.get_optimizer_cls_and_kwargs(args)


@pytest.mark.parametrize("optim_args, message", [
    ("blocksize=128", "Unknown optim_args key 'blocksize'.*supported keys: block_size"),
    ("block_size=12.5", "Invalid optim_args value block_size='12.5'.*an int"),
    ("min_quant_size=lots", "Invalid optim_args value min_quant_size='lots'"),
    ("bf16_stochastic_round=maybe", "Invalid optim_args value bf16_stochastic_round='maybe'.*bool"),
])
def test_bad_optim_args_name_the_culprit(tmp_path, optim_args, message):
    args = TrainingArguments(output_dir=str(tmp_path), optim="lowbit_adamw_4bit", optim_args=optim_args,
                             report_to="none", use_cpu=True)
    with pytest.raises(ValueError, match=message):
        Trainer.get_optimizer_cls_and_kwargs(args)


def test_out_of_range_optim_args_fail_in_the_constructor(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), optim="lowbit_adamw_4bit",
                             optim_args="block_size=100", report_to="none", use_cpu=True)
    optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    with pytest.raises(ValueError, match="Invalid block_size: 100"):
        optimizer_cls(tiny_gpt2().parameters(), **kwargs)


# --- a real Trainer run ---------------------------------------------------------------------
@pytest.mark.slow
def test_trainer_uses_our_optimizer_with_its_two_param_groups(full_run):
    trainer, _, _ = full_run
    optimizer = inner(trainer.optimizer)
    # The backend our optimizer picks by default for CPU parameters ("cpu" where the C++ kernel
    # builds, else "compile"): the Trainer passes nothing that changes it.
    assert type(optimizer) is AdamW4bit
    assert optimizer.backend == resolve_backend(None, [torch.device("cpu")])
    decay_names = set(trainer.get_decay_parameter_names(trainer.model))
    names = {id(p): n for n, p in trainer.model.named_parameters()}  # lm_head is tied to wte
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {names[id(p)] for p in decay["params"]} == decay_names & set(names.values())
    assert len(decay["params"]) + len(no_decay["params"]) == len(names)
    assert all("bias" in names[id(p)] or ".ln_" in names[id(p)] for p in no_decay["params"])


@pytest.mark.slow
def test_state_is_quantized_above_min_quant_size(full_run):
    trainer, _, _ = full_run
    optimizer = inner(trainer.optimizer)
    quantized = 0
    for param in trainer.model.parameters():
        state = optimizer.state[param]
        assert int(state["step"]) == STEPS
        if param.numel() >= 4096:
            for key in ("exp_avg", "exp_avg_sq"):
                assert isinstance(state[key], QuantizedState) and state[key].block_size == 128
                assert state[key].format_name == getattr(AdamW4bit, f"{key}_format").name
            quantized += param.numel()
        else:
            assert type(state["exp_avg"]) is torch.Tensor and state["exp_avg"].dtype == torch.float32
    # The six weight matrices (embeddings, attention, MLP) are ~97% of the parameters.
    assert quantized / sum(p.numel() for p in trainer.model.parameters()) > 0.9


@pytest.fixture(scope="module")
def short_runs(tmp_path_factory):
    """``short_runs(optim)``: a 4-step Trainer run with that optim name on the eager backend,
    run once per module (an ``_offload`` test reuses its plain name's run as the reference)."""
    runs = {}

    def run(optim):
        if optim not in runs:
            args = training_args(tmp_path_factory.mktemp(optim), optim=optim, optim_args="backend=eager",
                                 max_steps=4, save_strategy="no")
            runs[optim] = Trainer(model=tiny_gpt2(), args=args, train_dataset=byte_dataset())
            runs[optim].train()
        return runs[optim]

    return run


OPTIM_STRINGS = ["lowbit_adamw_4bit_factored", "lowbit_adamw_fp8", "lowbit_adamw_4bit_factored_offload",
                 "lowbit_adamw_fp8_offload"]


@pytest.mark.parametrize("optim", slow_except(OPTIM_STRINGS, "lowbit_adamw_fp8"))
def test_trainer_with_the_optim_string(short_runs, optim):
    """The class behind the name steps Trainer's two groups, with its state formats: factored
    second moments for AdamWFactored4bit's 2-D weights (GPT-2's Conv1D and embeddings). An
    ``_offload`` name steps the same class on the host and trains bit-identically to the plain name."""
    trainer = short_runs(optim)
    plain = optim.removesuffix("_offload")
    optimizer = inner(trainer.optimizer)
    assert type(optimizer) is BUILDS[optim][0]
    host_optimizer = getattr(optimizer, "host_optimizer", optimizer)  # what CPUOffloadOptimizer steps
    assert type(host_optimizer) is OPTIMIZERS[plain] and len(host_optimizer.param_groups) == 2
    weights = [p for group in host_optimizer.param_groups for p in group["params"] if p.numel() >= 4096]
    exp_avg_sq_type = FactoredState if OPTIMIZERS[plain] is AdamWFactored4bit else QuantizedState
    assert weights and all(p.dim() == 2 for p in weights)
    for param in weights:
        state = host_optimizer.state[param]
        assert int(state["step"]) == 4
        assert isinstance(state["exp_avg"], QuantizedState) and type(state["exp_avg_sq"]) is exp_avg_sq_type
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    if optim != plain:
        for (name, expected), actual in zip(short_runs(plain).model.named_parameters(),
                                            trainer.model.parameters(), strict=True):
            assert torch.equal(actual, expected), name


def test_trainer_trains_a_float16_model_with_24_bit_master_weights(tmp_path):
    """``optim_args="master_weight_bits=24"`` with a float16 model: every parameter keeps an
    int8 correction (float16's scaled residual) and the master weights export as float32."""
    args = training_args(tmp_path, optim="lowbit_adamw_8bit", max_steps=3, warmup_steps=0, save_strategy="no",
                         optim_args="master_weight_bits=24,backend=eager")
    trainer = Trainer(model=tiny_gpt2().half(), args=args, train_dataset=byte_dataset(40))
    trainer.train()
    optimizer = inner(trainer.optimizer)
    assert optimizer.defaults["master_weight_bits"] == 24
    corrections = [optimizer.state[p][CORRECTION_KEY] for p in trainer.model.parameters()]
    assert all(c.dtype == torch.int8 for c in corrections) and any(c.any() for c in corrections)
    exported = master_weights_state_dict(trainer.model, optimizer)
    assert all(exported[name].dtype == torch.float32 for name, _ in trainer.model.named_parameters())
    losses = [entry["loss"] for entry in step_logs(trainer)]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)


@pytest.mark.slow
def test_loss_goes_down(full_run):
    trainer, _, _ = full_run
    losses = [entry["loss"] for entry in step_logs(trainer)]
    assert len(losses) == STEPS and all(math.isfinite(loss) for loss in losses)
    # Measured: 5.35 over the first 3 steps -> 3.51 over the last 3 (ln 256 = 5.55 is chance).
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 1.0


@pytest.mark.slow
def test_scheduler_drives_our_lr_tensor_without_recompiles(full_run):
    trainer, recorder, graphs_before = full_run
    logged = [entry["learning_rate"] for entry in step_logs(trainer)]
    # Both groups hold the scheduler's float LR at every step, exactly as logged (a group LR
    # turned into a float32 tensor logged 0.0003000000142492354 for 3e-4)...
    for step_lrs, expected in zip(recorder.lrs, logged, strict=True):
        assert step_lrs == [expected, expected] and all(type(lr) is float for lr in step_lrs)
    assert len(set(logged)) > STEPS // 2  # warmup then cosine: the LR really changes
    # ...read into the optimizer's own tensors in place (the step before the first records
    # none), so the compiled step's inputs keep their identity.
    assert all(ids == recorder.lr_ids[1] for ids in recorder.lr_ids[1:])
    # The first step may compile (nothing if another test compiled the 4-bit step first);
    # nothing after it.
    assert recorder.graphs_after_step[0] - graphs_before <= 1
    assert recorder.graphs_after_step[-1] == recorder.graphs_after_step[0]


@pytest.mark.slow
def test_gradient_accumulation_and_clipping(full_run):
    trainer, recorder, _ = full_run
    # One optimizer step per ACCUMULATION micro-batches: our step counter follows global_step.
    assert trainer.state.global_step == STEPS
    assert recorder.substeps == STEPS * (ACCUMULATION - 1)
    pre_clip = [entry["grad_norm"] for entry in step_logs(trainer)]
    # torch's clip_grad_norm_ scales by max_norm / (norm + 1e-6): the relative slack below.
    for before, after in zip(pre_clip, recorder.clipped_norms, strict=True):
        assert after == pytest.approx(min(before, MAX_GRAD_NORM), rel=1e-5)
    assert max(pre_clip) > MAX_GRAD_NORM  # clipping really happened


@pytest.mark.slow
def test_resume_from_checkpoint_reproduces_the_uninterrupted_run(full_run, resumed_run):
    trainer, _, _ = full_run
    resumed, recorder, graphs_before = resumed_run
    assert resumed.state.global_step == STEPS and len(recorder.lrs) == STEPS - SAVE_AT
    # Same data order, same restored state, same (deterministic CPU) kernels: bit-exact.
    # The resumed log starts with the checkpoint's first SAVE_AT entries.
    assert [e["loss"] for e in step_logs(resumed)] == [e["loss"] for e in step_logs(trainer)]
    for (name, expected), actual in zip(trainer.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(actual, expected), name
    expected_state = inner(trainer.optimizer).state
    actual_state = inner(resumed.optimizer).state
    for expected_param, actual_param in zip(trainer.model.parameters(), resumed.model.parameters()):
        for key, value in expected_state[expected_param].items():
            assert torch.equal(actual_state[actual_param][key], value), key
    assert counters["stats"]["unique_graphs"] == graphs_before  # the loaded state reuses the graph


# --- other routes ---------------------------------------------------------------------------
def test_command_line_route(tmp_path):
    parser = HfArgumentParser(TrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(args=[
        "--output_dir", str(tmp_path), "--optim", "lowbit_adamw_8bit",
        "--optim_args", "block_size=128,min_quant_size=4096,bf16_stochastic_round=True,backend=eager",
        "--max_steps", "3", "--per_device_train_batch_size", "4", "--learning_rate", "1e-3",
        "--use_cpu", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true",
    ])
    assert args.optim is OptimizerNames("lowbit_adamw_8bit")
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=byte_dataset())
    trainer.train()
    optimizer = inner(trainer.optimizer)
    assert type(optimizer) is AdamW8bit and optimizer.backend == "eager"
    group = optimizer.param_groups[0]
    assert group["block_size"] == 128 and group["min_quant_size"] == 4096 and group["bf16_stochastic_round"]
    state = optimizer.state[trainer.model.transformer.wte.weight]
    assert isinstance(state["exp_avg"], QuantizedState)
    assert state["exp_avg"].format_name == AdamW8bit.exp_avg_format.name
    assert int(state["step"]) == 3


@pytest.mark.parametrize("route", ["optimizer_cls_and_kwargs", "optimizers"])
def test_routes_without_registration(tmp_path, route):
    model = tiny_gpt2()
    args = training_args(tmp_path, max_steps=2, gradient_accumulation_steps=1, save_strategy="no")
    if route == "optimizer_cls_and_kwargs":
        extra = {"optimizer_cls_and_kwargs": (AdamW8bit, {"lr": 1e-3, "backend": "eager"})}
    else:
        optimizer = AdamW8bit(model.parameters(), lr=1e-3, backend="eager")
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
        extra = {"optimizers": (optimizer, scheduler)}
    trainer = Trainer(model=model, args=args, train_dataset=byte_dataset(), **extra)
    trainer.train()
    optimizer = inner(trainer.optimizer)
    assert type(optimizer) is AdamW8bit
    # Trainer groups the parameters only when it builds the optimizer itself.
    assert len(optimizer.param_groups) == (2 if route == "optimizer_cls_and_kwargs" else 1)
    assert isinstance(optimizer.state[model.transformer.wte.weight]["exp_avg"], QuantizedState)
    if route == "optimizers":  # our scheduler, not Trainer's: 1e-3, then 1e-3 / 2
        assert [e["learning_rate"] for e in step_logs(trainer)] == pytest.approx([1e-3, 5e-4], rel=1e-6)


def test_accelerate_prepare_changes_nothing():
    """accelerator.prepare wraps model and optimizer; the trajectory must be bit-identical."""
    batches = [{k: torch.stack([row[k] for row in byte_dataset()[i:i + 4]]) for k in ("input_ids", "labels")}
               for i in range(0, 12, 4)]
    plain_model = tiny_gpt2()
    model = copy.deepcopy(plain_model)
    accelerator = accelerate.Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, AdamW4bit(model.parameters(), lr=1e-3))
    plain_optimizer = AdamW4bit(plain_model.parameters(), lr=1e-3)
    for batch in batches:
        accelerator.backward(model(**batch).loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        plain_model(**batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(plain_model.parameters(), 1.0)
        plain_optimizer.step()
        plain_optimizer.zero_grad()
    assert isinstance(optimizer.optimizer, AdamW4bit)
    for (name, actual), expected in zip(model.named_parameters(), plain_model.parameters()):
        assert torch.equal(actual, expected), name

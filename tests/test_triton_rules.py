"""Lion and AdEMAMix through the Triton step kernel (under the interpreter on CPU) against the
rule's reference step, ``rule_step.quantized_rule_step`` (``backend="eager"``: the rule's
``update`` operation for operation), and the whole optimizer against ``backend="compile"``.

Bounds. The moments of both rules do not depend on the parameter and the rules' pieces compute
them operation for operation as ``update`` (multiply-add contraction off), so block scales must
be identical and a code may differ only next to a bin edge (``kernel_helpers.assert_states_equal``;
checks of several steps copy the reference's state into the kernel's after each step, so one
such code does not compound). Lion's parameter is computed operation for operation too: it
must be identical, master weights included. AdEMAMix's divides by ``denom`` and the bias
correction through host reciprocals and adds ``eps`` with an FMA (exactly under the interpreter
otherwise): each a relative error of at most 2**-24 in a term of the update, so the parameter
change may differ from the reference's by ``AdEMAMIX_CHANGE_RMSE`` relative RMSE (measured:
1.8e-7 to 5.5e-7 per step, here and against ``backend="compile"``; a wrong bias correction,
schedule or weight decay moves it by > 1e-3).
"""

import pytest
import torch
from conftest import relative_rmse, slow_except

from lowbit_optim import AdEMAMix4bit, AdEMAMix8bit, Lion4bit, Lion8bit, QuantizedState
from lowbit_optim.step.chunks import TailScratch
from lowbit_optim.step.hyperparams import GroupScalars, StepOptions
from lowbit_optim.step.master_weights import split_master
from lowbit_optim.step.rule_step import RuleEntry, RulePlan, rule_graph_count

pytest.importorskip("triton")
from kernel_helpers import AdEMAMIX_CHANGE_RMSE, assert_states_equal, gradient  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from lowbit_optim.step.kernels import launcher  # noqa: E402

# NaN gradients (the non-finite policy) flow into the interpreter's numpy division before the
# kernel's selects put the old values back.
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning"),
              pytest.mark.usefixtures("interpreter")]

CLASSES = (Lion8bit, Lion4bit, AdEMAMix8bit, AdEMAMix4bit)
BLOCK_SIZE = {Lion8bit: 256, Lion4bit: 128, AdEMAMix8bit: 256, AdEMAMix4bit: 128}
# Per step: (lr, betas, weight_decay, alpha); AdEMAMix's warm-ups (t_alpha = t_beta3 = 2) end
# within the three steps, so both schedules change the constants too.
SCHEDULE = [(1e-2, (0.9, 0.99, 0.999), 0.1, 5.0), (5e-3, (0.8, 0.95, 0.99), 0.0, 4.0),
            (2e-2, (0.95, 0.999, 0.9999), 0.5, 8.0)]


def group_of(cls, lr, betas, weight_decay, alpha) -> dict:
    if cls in (Lion8bit, Lion4bit):
        return dict(lr=lr, betas=betas[:2], weight_decay=weight_decay)
    return dict(lr=lr, betas=betas, weight_decay=weight_decay, alpha=alpha, eps=1e-8, t_alpha=2, t_beta3=2)


def make_entries(cls, numels, dtype, master_weights):
    """Parameters with random quantized moments in ``cls``'s formats (and, for bfloat16 with
    master weights, their int16 corrections)."""
    rule, entries = cls.rule, []
    step = torch.zeros(())
    for numel in numels:
        master = torch.randn(numel)
        param, correction = (split_master(master, torch.bfloat16, torch.int16) if master_weights
                             else (master.to(dtype), None))
        moments = tuple(QuantizedState.from_float(
            torch.randn(numel) * 0.1 if spec.signed else torch.rand(numel) * 0.01,
            cls.signed_format if spec.signed else cls.unsigned_format, BLOCK_SIZE[cls])
            for spec in rule.moments)
        entries.append(RuleEntry(param, torch.zeros(numel, dtype=param.dtype), moments, step, correction))
    return entries


def clone(entries):
    step = entries[0].step.clone()
    return [RuleEntry(e.param.clone(), e.grad, tuple(m.clone() for m in e.moments), step,
                      None if e.weight_correction is None else e.weight_correction.clone()) for e in entries]


def resync(entries, reference):
    for entry, ref in zip(entries, reference):
        entry.param.copy_(ref.param)
        if entry.weight_correction is not None:
            entry.weight_correction.copy_(ref.weight_correction)
        for moment, ref_moment in zip(entry.moments, ref.moments):
            moment.codes.copy_(ref_moment.codes)
            moment.scales.copy_(ref_moment.scales)


def run_against_reference(cls, *, dtype=torch.float32, master_weights=False, maximize=False):
    rule = cls.rule
    kernel_entries = make_entries(cls, (4097, 777), dtype, master_weights)
    reference = clone(kernel_entries)
    kernel_plan, reference_plan = RulePlan(rule, kernel_entries, "triton"), RulePlan(rule, reference, "eager")
    assert kernel_plan.kernel is not None and not kernel_plan.quantized
    scalars, options, scratch = GroupScalars(rule), StepOptions(maximize, False), TailScratch()
    for step, hyper in enumerate(SCHEDULE, start=1):
        scalars.refresh(group_of(cls, *hyper))
        for entries in (kernel_entries, reference):
            entries[0].step.fill_(step)
        grads = [gradient(e.param.numel(), dtype) for e in kernel_entries]
        before = [e.param.float().clone() for e in reference]
        kernel_plan.run(grads, scalars, options, scratch)
        reference_plan.run(grads, scalars, options, scratch)
        for index, (entry, ref, start) in enumerate(zip(kernel_entries, reference, before)):
            name = f"{cls.__name__}, param {index}, step {step}"
            assert_states_equal(entry.moments, ref.moments, name)
            if cls in (Lion8bit, Lion4bit):
                assert torch.equal(entry.param, ref.param), name
                if master_weights:
                    assert torch.equal(entry.weight_correction, ref.weight_correction), name
            else:
                change = relative_rmse(entry.param.float() - start, ref.param.float() - start)
                assert change < AdEMAMIX_CHANGE_RMSE, f"{name}: relative RMSE of the change {change:.3g}"
        resync(kernel_entries, reference)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_matches_the_rule_step(cls):
    """Odd sizes (4097: whole blocks in the aligned launch and a tail; 777: unaligned), NaN and
    inf gradients, three steps of changing hyperparameters and schedules."""
    run_against_reference(cls)


@pytest.mark.parametrize("cls", [Lion8bit, AdEMAMix4bit], ids=lambda c: c.__name__)
def test_maximize_and_bf16_master_weights(cls):
    run_against_reference(cls, dtype=torch.bfloat16, master_weights=True, maximize=True)


class LaunchRecorder:
    """Wraps the real kernel; records each launch's compile-time options and constants."""

    def __init__(self, kernel):
        self.kernel, self.variants, self.constants = kernel, [], []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.variants.append(tuple(sorted((k, v) for k, v in kwargs.items() if k != "UPDATE")))
            self.constants.append(args[launcher.CONSTANTS_ARGUMENT])
            return self.kernel[grid](*args, **kwargs)
        return run


def formats_of(cls):
    return tuple(cls.signed_format if spec.signed else cls.unsigned_format for spec in cls.rule.moments)


# The 4-bit classes' compiled graphs are compiles of their own: slow tier (the kernel's 4-bit
# rules are checked against the reference step in the fast tier above).
@pytest.mark.parametrize("cls", slow_except(CLASSES, Lion8bit, AdEMAMix8bit), ids=lambda c: c.__name__)
def test_optimizer_triton_backend_matches_compile(cls, monkeypatch):
    """The whole optimizer: two quantized parameters of odd sizes through the kernel (per step
    one launch for the aligned pieces, one for the unaligned), a small float32-state one
    through the float step, against ``backend="compile"``. An LR schedule (and AdEMAMix's alpha
    and beta3 warm-ups) change the kernel's constants at every step, never its compile-time
    variant, and nothing of the rule goes through the compiled step."""
    recorder = LaunchRecorder(launcher.lowbit_step_kernel)
    monkeypatch.setattr(launcher, "lowbit_step_kernel", recorder)
    torch.manual_seed(0)
    weights = [torch.randn(4097), torch.randn(777), torch.randn(10)]
    options = {} if cls in (Lion8bit, Lion4bit) else dict(t_alpha=2, t_beta3=3)
    runs = {}
    for backend in ("triton", "compile"):
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        optimizer = cls(params, lr=1e-2, weight_decay=0.1, min_quant_size=100, backend=backend, **options)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        generator = torch.Generator().manual_seed(1)
        graphs_before = rule_graph_count(cls.rule, formats_of(cls))
        for _ in range(3):
            for param in params:
                param.grad = torch.randn(param.shape, generator=generator)
            optimizer.step()
            scheduler.step()
        runs[backend] = (params, optimizer)
        if backend == "triton":
            assert [dict(v)["ALIGNED"] for v in recorder.variants] == [True, False] * 3
            assert len(set(recorder.variants)) == 2  # one variant per alignment class
            assert len(set(recorder.constants)) == 3  # new constants at every step
            assert rule_graph_count(cls.rule, formats_of(cls)) == graphs_before
    (kernel, kernel_optimizer), (compiled, compiled_optimizer) = runs["triton"], runs["compile"]
    for index, (a, e, w) in enumerate(zip(kernel, compiled, weights)):
        if cls in (Lion8bit, Lion4bit) or index == 2:
            assert torch.equal(a, e), f"param {index}"
        else:
            change = relative_rmse(a.detach() - w, e.detach() - w)
            assert change < AdEMAMIX_CHANGE_RMSE, f"param {index}: relative RMSE of the change {change:.3g}"
    for index in (0, 1):
        keys = cls.rule.all_moment_keys
        assert_states_equal([kernel_optimizer.state[kernel[index]][k] for k in keys],
                            [compiled_optimizer.state[compiled[index]][k] for k in keys], f"param {index}")


def test_rules_without_amsgrad_refuse_it():
    """amsgrad is AdamW's option: the Lion and AdEMAMix classes take bitsandbytes' arguments,
    which have none."""
    for cls in CLASSES:
        with pytest.raises(TypeError):
            cls([torch.nn.Parameter(torch.zeros(10))], amsgrad=True)


def test_a_piece_built_for_the_other_mode_is_refused():
    """Triton decides between interpreter and compiler when a function is defined: a rule's
    piece defined before ``TRITON_INTERPRET`` was set cannot run in the interpreted kernel."""
    compiled_piece = JITFunction(Lion8bit.rule.kernel_update.fn)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET before lowbit_optim is first imported"):
        launcher.check_update(launcher.KernelUpdate(compiled_piece))

"""Checkpoints: exact resume, dtype/device casts on load, conversion to and from
torch.optim.AdamW, and state dicts that do not fit."""

import io
import re
from pathlib import Path

import pytest
import torch
from conftest import relative_rmse
from helpers import assert_same_state
from torch import nn

from lowbit_optim import AdamW4bit, AdamW8bit, AdamWFactored4bit, AdamWFp8, FactoredState, QuantizedState
from lowbit_optim.checkpoint import from_torch_adamw, to_torch_adamw

OPTIMIZERS = [AdamW8bit, AdamW4bit, AdamWFp8]
DOCS = Path(__file__).resolve().parent.parent / "docs" / "checkpoints.md"


def round_trip(obj, **load_kwargs):
    """What torch.save then torch.load(weights_only=True) gives back."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True, **load_kwargs)


# --- exact resume ---------------------------------------------------------------------------
class Setup:
    """A small two-layer model with two param groups, an optimizer and a warmup+cosine
    schedule. Layer sizes are not multiples of either block size (partial last blocks), the
    weights are quantized, the biases keep float32 state, and one parameter never gets a
    gradient (it has no state)."""

    def __init__(self, cls, dtype, *, backend, stochastic_round):
        self.dtype = dtype
        self.model = nn.Sequential(nn.Linear(40, 100), nn.Tanh(), nn.Linear(100, 24)).to(dtype)
        self.unused = nn.Parameter(torch.randn(7, dtype=dtype))
        weights = [self.model[0].weight, self.model[2].weight]
        others = [self.model[0].bias, self.model[2].bias, self.unused]
        self.optimizer = cls(
            [{"params": weights, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0, "lr": 3e-3}],
            lr=1e-2, min_quant_size=1024, bf16_stochastic_round=stochastic_round, backend=backend,
        )
        warmup = torch.optim.lr_scheduler.LinearLR(self.optimizer, start_factor=0.1, total_iters=3)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=10)
        self.scheduler = torch.optim.lr_scheduler.SequentialLR(
            self.optimizer, [warmup, cosine], milestones=[3]
        )

    def train(self, first_step: int, steps: int) -> None:
        for step in range(first_step, first_step + steps):
            # Data from the step number alone, so a resumed run sees the same batches.
            generator = torch.Generator().manual_seed(step)
            inputs = torch.randn(16, 40, generator=generator).to(self.dtype)
            targets = torch.randn(16, 24, generator=generator).to(self.dtype)
            loss = nn.functional.mse_loss(self.model(inputs).float(), targets.float())
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            self.scheduler.step()

    def checkpoint(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "unused": self.unused.detach(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            # bf16 stochastic rounding draws from torch's global generator (docs/checkpoints.md).
            "rng": torch.get_rng_state(),
        }

    def restore(self, checkpoint: dict, *, rng: bool = True) -> None:
        self.model.load_state_dict(checkpoint["model"])
        with torch.no_grad():
            self.unused.copy_(checkpoint["unused"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        self.scheduler.load_state_dict(checkpoint["scheduler"])
        if rng:
            torch.set_rng_state(checkpoint["rng"])

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in [*self.model.parameters(), self.unused]]


RESUME_CASES = [
    (AdamW8bit, torch.float32, "compile", False),
    (AdamW8bit, torch.float32, "eager", False),
    (AdamW4bit, torch.float32, "eager", False),
    (AdamW8bit, torch.bfloat16, "eager", True),
    (AdamW4bit, torch.bfloat16, "eager", True),
    (AdamWFp8, torch.float32, "compile", False),
    (AdamWFp8, torch.bfloat16, "eager", True),
    (AdamWFactored4bit, torch.float32, "compile", False),  # both weights factored
    (AdamWFactored4bit, torch.bfloat16, "eager", True),
]


# Each compiled case compiles its class's graphs (~10-20 s on 2 cores): slow tier.
@pytest.mark.parametrize("cls, dtype, backend, stochastic_round", [
    pytest.param(c, d, b, sr, id=f"{c.__name__}-{str(d)[6:]}-{b}{'-sr' if sr else ''}",
                 marks=[pytest.mark.slow] if b == "compile" else [])
    for c, d, b, sr in RESUME_CASES
])
def test_resume_is_bit_identical_to_an_uninterrupted_run(cls, dtype, backend, stochastic_round):
    before, after = 7, 6  # the resume point lies past the warmup, inside the cosine phase

    torch.manual_seed(0)
    uninterrupted = Setup(cls, dtype, backend=backend, stochastic_round=stochastic_round)
    uninterrupted.train(0, before + after)

    torch.manual_seed(0)
    first = Setup(cls, dtype, backend=backend, stochastic_round=stochastic_round)
    first.train(0, before)
    saved = round_trip(first.checkpoint())
    torch.manual_seed(1)  # a fresh process: other initial weights, other generator state
    resumed = Setup(cls, dtype, backend=backend, stochastic_round=stochastic_round)
    resumed.restore(saved)
    resumed.train(before, after)

    for index, (a, b) in enumerate(zip(resumed.params(), uninterrupted.params())):
        assert torch.equal(a, b), f"parameter {index} differs after resuming"
    assert_same_state(resumed.optimizer.state_dict(), uninterrupted.optimizer.state_dict())
    assert resumed.scheduler.state_dict() == uninterrupted.scheduler.state_dict()
    for group, expected in zip(resumed.optimizer.param_groups, uninterrupted.optimizer.param_groups):
        assert type(group["lr"]) is type(expected["lr"]) and group["lr"] == expected["lr"]
    state = resumed.optimizer.state
    assert resumed.unused not in state, "a parameter that never had a gradient gets no state"
    bias_state = state[resumed.model[0].bias]
    assert bias_state["exp_avg"].dtype == torch.float32, "float32 state stays float32 on load"
    assert bias_state["step"].dtype == torch.float32 and bias_state["step"].item() == before + after

    if stochastic_round:
        # The generator state is part of what makes the resume exact: without it the
        # rounding noise, and so the parameters, differ.
        torch.manual_seed(1)
        other = Setup(cls, dtype, backend=backend, stochastic_round=stochastic_round)
        other.restore(saved, rng=False)
        other.train(before, after)
        assert not all(torch.equal(a, b) for a, b in zip(other.params(), uninterrupted.params()))


def trained(cls, dtype=torch.float32, steps=3, amsgrad=False):
    weight = nn.Parameter(torch.randn(50, 90, dtype=dtype))  # 4500 elements: quantized
    bias = nn.Parameter(torch.randn(50, dtype=dtype))  # float32 state
    optimizer = cls([weight, bias], lr=1e-2, amsgrad=amsgrad, backend="eager")
    for _ in range(steps):
        weight.grad, bias.grad = torch.randn_like(weight), torch.randn_like(bias)
        optimizer.step()
    return weight, bias, optimizer


@pytest.mark.parametrize("cls", [*OPTIMIZERS, AdamWFactored4bit], ids=lambda c: c.__name__)
def test_a_state_dict_with_float_moments_is_stored_again_on_load(cls):
    """What a full state dict gathered from FSDP2 holds: our groups, but each moment as its
    float values. Loaded, each is stored again in the optimizer's format: quantized once more
    over the same blocks (the same values, except in a block whose largest magnitude is
    negative: the signed maps stop short of -1, docs/distributed.md), or the same statistics
    to float rounding (factoring a reconstruction)."""
    weight, bias, optimizer = trained(cls)
    saved = round_trip(optimizer.state_dict())
    as_floats = round_trip(optimizer.state_dict())
    for entry in as_floats["state"].values():
        for key in ("exp_avg", "exp_avg_sq"):
            if isinstance(entry[key], (QuantizedState, FactoredState)):
                entry[key] = entry[key].dequantize(torch.float32)
    target = cls([nn.Parameter(weight.detach().clone()), nn.Parameter(bias.detach().clone())],
                 lr=1e-2, backend="eager")
    target.load_state_dict(as_floats)
    loaded = target.state_dict()
    for key in ("exp_avg", "exp_avg_sq"):
        value, expected = loaded["state"][0][key], saved["state"][0][key]
        assert type(value) is type(expected), key
        if isinstance(expected, FactoredState):
            torch.testing.assert_close(value.row, expected.row, rtol=1e-6, atol=0)
            torch.testing.assert_close(value.col, expected.col, rtol=1e-6, atol=0)
        else:
            again = QuantizedState.from_float(expected.dequantize(), expected.format, expected.block_size)
            assert torch.equal(value.dequantize(), again.dequantize()), key
        assert torch.equal(loaded["state"][1][key], saved["state"][1][key])


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_dtype_cast_on_load_keeps_codes_scales_and_float32_state(cls):
    # Optimizer.load_state_dict casts state tensors to the parameter dtype (torchao's 8-bit
    # state lost its codes that way, pytorch/ao#3314); saved with float32 parameters and
    # loaded for bfloat16 ones, every stored bit must come through.
    weight, bias, optimizer = trained(cls)
    saved = round_trip(optimizer.state_dict(), map_location="cpu")
    weight16, bias16 = nn.Parameter(weight.detach().bfloat16()), nn.Parameter(bias.detach().bfloat16())
    target = cls([weight16, bias16], backend="eager")
    target.load_state_dict(saved)
    expected = optimizer.state_dict()
    for key in ("exp_avg", "exp_avg_sq"):
        loaded, original = target.state[weight16][key], expected["state"][0][key]
        assert isinstance(loaded, QuantizedState) and loaded.dtype == torch.bfloat16
        assert torch.equal(loaded.codes, original.codes) and torch.equal(loaded.scales, original.scales)
        small = target.state[bias16][key]
        assert small.dtype == torch.float32 and torch.equal(small, expected["state"][1][key])
    assert target.state[weight16]["step"].dtype == torch.float32
    weight16.grad, bias16.grad = torch.randn_like(weight16), torch.randn_like(bias16)
    target.step()
    assert torch.isfinite(weight16).all()


@pytest.mark.cuda
def test_load_across_devices():
    weight, bias, optimizer = trained(AdamW8bit)
    on_cuda = [nn.Parameter(p.detach().cuda()) for p in (weight, bias)]
    cuda_optimizer = AdamW8bit(on_cuda, backend="eager")
    cuda_optimizer.load_state_dict(round_trip(optimizer.state_dict()))
    state = cuda_optimizer.state[on_cuda[0]]
    assert state["exp_avg"].codes.is_cuda and state["exp_avg"].scales.is_cuda
    assert state["step"].device.type == "cpu"
    assert cuda_optimizer.state[on_cuda[1]]["exp_avg"].is_cuda
    back = [nn.Parameter(p.detach().cpu()) for p in on_cuda]
    cpu_optimizer = AdamW8bit(back, backend="eager")
    cpu_optimizer.load_state_dict(round_trip(cuda_optimizer.state_dict(), map_location="cpu"))
    assert_same_state(cpu_optimizer.state_dict(), optimizer.state_dict())
    for param in on_cuda:
        param.grad = torch.randn_like(param)
    cuda_optimizer.step()
    assert torch.isfinite(on_cuda[0]).all()


# --- conversion -----------------------------------------------------------------------------
@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_torch_adamw_state_dict_loads_quantized(cls):
    weight = nn.Parameter(torch.randn(50, 90))
    bias = nn.Parameter(torch.randn(50))
    reference = torch.optim.AdamW([weight, bias], lr=1e-2, weight_decay=0.05, amsgrad=True)
    for _ in range(3):
        weight.grad, bias.grad = torch.randn_like(weight), torch.randn_like(bias)
        reference.step()
    torch_state = round_trip(reference.state_dict())
    optimizer = cls([weight, bias], backend="eager")
    optimizer.load_state_dict(torch_state)

    group = optimizer.param_groups[0]
    assert float(group["lr"]) == pytest.approx(1e-2) and group["weight_decay"] == 0.05 and group["amsgrad"]
    assert isinstance(group["lr"], float) and group["block_size"] == cls.exp_avg_format.default_block_size
    # torch.optim.AdamW's implementation options are ours too now (accepted, and meaningless
    # for a step that is always fused): carried as saved, and no key beyond our own options.
    assert set(group) == {"params", *optimizer.defaults}
    torch_options = ("fused", "foreach", "capturable", "differentiable")
    assert {key: group[key] for key in torch_options} == {
        key: torch_state["param_groups"][0][key] for key in torch_options}
    for key, fmt in [("exp_avg", cls.exp_avg_format), ("exp_avg_sq", cls.exp_avg_sq_format),
                     ("max_exp_avg_sq", cls.exp_avg_sq_format)]:
        expected = QuantizedState.from_float(torch_state["state"][0][key], fmt, group["block_size"])
        assert torch.equal(optimizer.state[weight][key].codes, expected.codes), key
        assert torch.equal(optimizer.state[bias][key], torch_state["state"][1][key]), key
    assert optimizer.state[weight]["step"].item() == 3

    # Training continues from the converted state close to where torch's would have gone.
    start, grad = weight.detach().clone(), torch.randn_like(weight)
    moved = []
    for optim in (reference, optimizer):
        with torch.no_grad():
            weight.copy_(start)
        weight.grad, bias.grad = grad, None
        optim.step()
        moved.append(weight.detach() - start)
    # One step moves each weight by about lr; the moments' quantization error (8-bit ~1%,
    # 4-bit ~10% of the update, tests/test_optimizer.py) bounds how far the two steps differ.
    assert relative_rmse(moved[1], moved[0]) < 0.2


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_export_loads_into_torch_adamw(cls):
    weight, bias, optimizer = trained(cls, amsgrad=True)
    exported = round_trip(to_torch_adamw(optimizer.state_dict()))
    reference = torch.optim.AdamW([weight, bias])
    reference.load_state_dict(exported)
    ours = optimizer.state[weight]
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        assert torch.equal(reference.state[weight][key], ours[key].dequantize(torch.float32)), key
        assert torch.equal(reference.state[bias][key], optimizer.state[bias][key]), key
    group = reference.param_groups[0]
    assert group["lr"] == pytest.approx(1e-2) and isinstance(group["lr"], float)
    assert group["decoupled_weight_decay"] and group["amsgrad"]
    weight.grad, bias.grad = torch.randn_like(weight), torch.randn_like(bias)
    reference.step()
    assert torch.isfinite(weight).all()


def test_factored_state_converts_to_and_from_torch_adamw_and_survives_a_dtype_cast():
    """AdamWFactored4bit's second moment: exported as the outer product it stands for, factored
    from torch's full one by its row and column means, kept float32 when loaded for bfloat16
    parameters, and refused where the other kind is expected."""
    weight, bias, optimizer = trained(AdamWFactored4bit)
    state = optimizer.state[weight]["exp_avg_sq"]
    assert isinstance(state, FactoredState)

    exported = round_trip(to_torch_adamw(optimizer.state_dict()))
    full = exported["state"][0]["exp_avg_sq"]
    assert full.shape == weight.shape
    # To float rounding: the package takes the columns' mean in float64 and, when factoring,
    # divides each value before summing (neither may overflow): a few roundings of 2**-24.
    torch.testing.assert_close(full, state.row[:, None] * (state.col / state.col.mean())[None, :],
                               rtol=1e-6, atol=0)
    reference = torch.optim.AdamW([weight, bias])
    reference.load_state_dict(exported)
    weight.grad, bias.grad = torch.randn_like(weight), torch.randn_like(bias)
    reference.step()  # torch steps from the reconstructed second moment
    reference_sd = round_trip(reference.state_dict())
    imported = AdamWFactored4bit([weight, bias], backend="eager")
    imported.load_state_dict(reference_sd)
    factored = imported.state[weight]["exp_avg_sq"]
    torch_sq = reference_sd["state"][0]["exp_avg_sq"]
    torch.testing.assert_close(factored.row, torch_sq.mean(dim=1), rtol=1e-6, atol=0)
    torch.testing.assert_close(factored.col, torch_sq.mean(dim=0), rtol=1e-6, atol=0)
    assert torch.equal(imported.state[bias]["exp_avg_sq"], reference_sd["state"][1]["exp_avg_sq"])

    saved = round_trip(optimizer.state_dict())
    weight16, bias16 = nn.Parameter(weight.detach().bfloat16()), nn.Parameter(bias.detach().bfloat16())
    target = AdamWFactored4bit([weight16, bias16], backend="eager")
    target.load_state_dict(saved)
    loaded = target.state[weight16]["exp_avg_sq"]
    assert loaded.dtype == torch.bfloat16 and loaded.row.dtype == torch.float32
    assert torch.equal(loaded.row, state.row) and torch.equal(loaded.col, state.col)
    weight16.grad, bias16.grad = torch.randn_like(weight16), torch.randn_like(bias16)
    target.step()
    assert torch.isfinite(weight16).all()

    with pytest.raises(ValueError, match=r"exp_avg_sq must be a FactoredState .*got a QuantizedState"):
        AdamWFactored4bit([weight, bias]).load_state_dict(trained(AdamW4bit)[2].state_dict())
    with pytest.raises(ValueError, match=r"exp_avg_sq is a FactoredState; AdamW4bit does not factor it"):
        AdamW4bit([weight, bias]).load_state_dict(optimizer.state_dict())
    negative = round_trip(optimizer.state_dict())
    negative["state"][0]["exp_avg_sq"].row[0] = -1.0
    with pytest.raises(ValueError, match=r"parameter 0 .*exp_avg_sq: row must be finite and >= 0"):
        AdamWFactored4bit([weight, bias]).load_state_dict(negative)
    short = round_trip(optimizer.state_dict())
    short["state"][0]["exp_avg_sq"] = FactoredState(state.row[:-1], state.col, state.shape)
    message = r"exp_avg_sq: row is torch.float32 \(49,\), expected torch.float32 \(50,\)"
    with pytest.raises(ValueError, match=message):
        AdamWFactored4bit([weight, bias]).load_state_dict(short)


def test_switching_formats_goes_through_the_torch_state_dict():
    weight, bias, optimizer = trained(AdamW8bit)
    with pytest.raises(ValueError, match=r"stored as dynamic8-signed; AdamW4bit uses dynamic4-signed"):
        AdamW4bit([weight, bias]).load_state_dict(optimizer.state_dict())
    four_bit = AdamW4bit([weight, bias], backend="eager")
    four_bit.load_state_dict(to_torch_adamw(optimizer.state_dict()))
    for key, fmt in [("exp_avg", AdamW4bit.exp_avg_format), ("exp_avg_sq", AdamW4bit.exp_avg_sq_format)]:
        # The 8-bit values, dequantized, are what the 4-bit state quantizes.
        expected = QuantizedState.from_float(optimizer.state[weight][key].dequantize(torch.float32), fmt, 128)
        assert torch.equal(four_bit.state[weight][key].codes, expected.codes), key
        assert torch.equal(four_bit.state[weight][key].scales, expected.scales), key


def test_adam_with_l2_weight_decay_is_not_converted():
    param = nn.Parameter(torch.randn(5000))
    adam = torch.optim.Adam([param], weight_decay=0.1)
    with pytest.raises(ValueError, match="L2 weight decay"):
        from_torch_adamw(AdamW8bit([param]), adam.state_dict())


# --- state dicts that do not fit ------------------------------------------------------------
def corrupt(key, change):
    """A mutation of parameter 0's state (the quantized weight) or of the whole dict."""
    def apply(state_dict):
        if key is None:
            change(state_dict)
        else:
            state_dict["state"][0][key] = change(state_dict["state"][0][key])
        return state_dict
    return apply


def _relabel(state, **changes):
    parts = dict(codes=state.codes, scales=state.scales, format_name=state.format_name,
                 shape=state.shape, dtype=state.dtype)
    parts.update(changes)
    return QuantizedState(**parts)


BAD_STATE_DICTS = {
    "codes-dtype": (corrupt("exp_avg", lambda s: _relabel(s, codes=s.codes.to(torch.int16))),
                    r"parameter 0 \(group 0, position 0, shape \(50, 90\)\): exp_avg: codes are torch.int16"),
    "codes-rows": (corrupt("exp_avg_sq", lambda s: _relabel(s, codes=s.codes[:-1])),
                   r"parameter 0 .*exp_avg_sq: codes are torch.uint8 \(\d+, \d+\), expected"),
    "scales-dtype": (corrupt("exp_avg", lambda s: _relabel(s, scales=s.scales.half())),
                     r"parameter 0 .*: scales are torch.float16"),
    "scales-nan": (corrupt("exp_avg", lambda s: _relabel(s, scales=s.scales * float("nan"))),
                   r"parameter 0 .*: scales must be finite"),
    "state-shape": (corrupt("exp_avg", lambda s: _relabel(s, shape=(90, 50))),
                    r"parameter 0 .*: exp_avg has shape \(90, 50\), not the parameter's"),
    # (A float moment is stored again: a full state dict gathered from FSDP2 holds floats.)
    "integer-moment": (corrupt("exp_avg", lambda s: s.dequantize().to(torch.int32)),
                       r"parameter 0 .*: exp_avg must be a QuantizedState \(dynamic8-signed, "
                       r"block_size=256\), got a plain torch.int32 tensor"),
    "not-a-tensor": (corrupt("exp_avg", lambda s: [1, 2]), r"parameter 0 .*exp_avg is a list"),
    "other-format": (corrupt("exp_avg", lambda s: _relabel(s, format_name="dynamic8-unsigned")),
                     r"parameter 0 .*stored as dynamic8-unsigned; AdamW8bit uses dynamic8-signed"),
    "step-nan": (corrupt("step", lambda s: torch.tensor(float("nan"))), r"parameter 0 .*'step' must be"),
    "step-str": (corrupt("step", lambda s: "3"), r"parameter 0 .*'step' must be"),
    "missing-moment": (corrupt(None, lambda d: d["state"][1].pop("exp_avg_sq")),
                       r"parameter 1 \(group 0, position 1, shape \(50,\)\): state has no exp_avg_sq"),
    "amsgrad-mismatch": (corrupt(None, lambda d: d["param_groups"][0].update(amsgrad=True)),
                         r"parameter 0 .*state has no max_exp_avg_sq"),
    "unknown-id": (corrupt(None, lambda d: d["state"].update({7: {}})), r"parameter id 7, which no group"),
    "bad-block-size": (corrupt(None, lambda d: d["param_groups"][0].update(block_size=100)),
                       r"parameter group 0 of the loaded state dict: Invalid block_size: 100"),
    "group-count": (corrupt(None, lambda d: d["param_groups"].append(dict(d["param_groups"][0]))),
                    r"2 parameter groups, this optimizer 1"),
    "param-count": (corrupt(None, lambda d: d["param_groups"][0]["params"].append(2)),
                    r"parameter group 0 of the loaded state dict has 3 parameters"),
}


@pytest.mark.parametrize("mutate, message", BAD_STATE_DICTS.values(), ids=BAD_STATE_DICTS.keys())
def test_a_state_dict_that_does_not_fit_is_refused_and_changes_nothing(mutate, message):
    weight, bias, optimizer = trained(AdamW8bit)
    before = round_trip(optimizer.state_dict())
    with pytest.raises(ValueError, match=message):
        optimizer.load_state_dict(mutate(round_trip(optimizer.state_dict())))
    assert_same_state(optimizer.state_dict(), before)


def test_other_parameter_shapes_are_refused_by_name():
    weight, bias, optimizer = trained(AdamW8bit)
    other = AdamW8bit([("encoder.weight", nn.Parameter(torch.randn(90, 50))), ("encoder.bias", bias)])
    message = r"parameter 0 'encoder.weight' \(group 0, position 0, shape \(90, 50\)\): exp_avg has shape"
    with pytest.raises(ValueError, match=message):
        other.load_state_dict(optimizer.state_dict())
    reference = torch.optim.AdamW([weight, bias])
    weight.grad, bias.grad = torch.randn_like(weight), torch.randn_like(bias)
    reference.step()
    with pytest.raises(ValueError, match=message):
        other.load_state_dict(reference.state_dict())
    assert not other.state


# --- the docs -------------------------------------------------------------------------------
def test_docs_snippets_run(tmp_path, monkeypatch):
    snippets = re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.DOTALL)
    assert snippets, f"no python snippets in {DOCS}"
    monkeypatch.chdir(tmp_path)
    namespace = {}
    for snippet in snippets:
        exec(compile(snippet, str(DOCS), "exec"), namespace)

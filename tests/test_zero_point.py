"""No element's update blows up, whatever the gradients (the zero-point hazard).

Adam's own bound. With ``m_t = (1 - b1) sum_k b1**k g_{t-k}`` and ``v_t = (1 - b2) sum_k
b2**k g_{t-k}**2``, Cauchy-Schwarz gives ``|m_t| <= (1 - b1) sqrt(sum_k (b1**2 / b2)**k)
sqrt(v_t / (1 - b2))``, so with ``gamma = b1**2 / b2 < 1``

    |m_hat / sqrt(v_hat)| <= (1 - b1) / sqrt((1 - b2) (1 - gamma)) * sqrt(1 - b2**t) / (1 - b1**t)

(7.27 * sqrt(1 - b2**t) / (1 - b1**t) for the default betas). Quantized moments add their
rounding: the stored first moment can be larger than the true one and the second smaller.
``QUANTIZATION_ALLOWANCE`` bounds that factor: a map with no zero code never decodes a
positive second moment below about half its true value (its smallest positive step), and the
first moment's error is a fraction of its block's largest value. A second-moment code that
decodes to exactly 0 while the first moment is not 0 (the hazard: ``lr * m_hat / eps``) breaks
the bound by orders of magnitude.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowbit_optim import AdamW4bit, AdamW8bit, AdamWFactored4bit, AdamWFp8, FactoredState, QuantizedState
from lowbit_optim.bench import harness
from lowbit_optim.formats.catalog import FLOAT8

OPTIMIZERS = [AdamW8bit, AdamW4bit, AdamWFp8, AdamWFactored4bit]
# The main benchmark's zero-free ablation of AdamW8bit (the plain map's edges, code 0 read as
# half the smallest value) must be as safe as the default to be a candidate for it.
EDGES_KEPT_8BIT = harness.OPTIMIZERS["lowbit_8bit_edges_kept"].build
BETAS = (0.9, 0.999)
QUANTIZATION_ALLOWANCE = 4.0


def adam_bound(step: int, betas=BETAS) -> float:
    beta1, beta2 = betas
    gamma = beta1**2 / beta2
    ratio = (1 - beta1) / math.sqrt((1 - beta2) * (1 - gamma))
    return ratio * math.sqrt(1 - beta2**step) / (1 - beta1**step)


def repro_move(make) -> float:
    """The zero-point repro: a gradient 1e-4 next to 1.0 in one block, then 0; returns how far
    the small element moved."""
    param = torch.nn.Parameter(torch.zeros(4096))
    optimizer = make([param])
    grad = torch.full((4096,), 1e-4)
    grad[::256] = 1.0
    for step_grad in (grad, torch.zeros(4096)):
        param.grad = step_grad.clone()
        optimizer.step()
    return param[1].item()


@pytest.mark.parametrize("cls", [*OPTIMIZERS, EDGES_KEPT_8BIT], ids=lambda c: c.__name__)
def test_zero_point_repro_moves_at_most_ten_times_torch(cls):
    """The old 8-bit second moment decoded the small element's v to 0 and moved it by -4.20
    (torch: -0.00167)."""
    expected = repro_move(lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    actual = repro_move(lambda ps: cls(ps, lr=1e-3))
    assert abs(actual) <= 10 * abs(expected), (actual, expected)
    assert actual < 0, "still moves against the gradient"


def test_float8_second_moment_with_a_zero_code_has_the_hazard():
    """Why AdamWFp8's second moment is zero-free: with torchao's plain e4m3fn layout (code 0
    is 0, the smallest positive value 4.4e-6 of the block's largest) the repro's v of
    1e-8 / 1 decodes to 0 and the element jumped by -4.54 (torchao's AdamWFp8 quantizes the
    same way). The step's clamp at Adam's own bound now stops the jump at that bound (here
    1.2x torch's move), and the zero-free map stays below torch's move."""

    class PlainFloat8(AdamWFp8):
        exp_avg_sq_format = FLOAT8

    expected = repro_move(lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    plain = repro_move(lambda ps: PlainFloat8(ps, lr=1e-3))
    assert 1.1 * abs(expected) < abs(plain) <= 1e-3 * (adam_bound(1) + adam_bound(2)) * (1 + 1e-6)
    assert abs(repro_move(lambda ps: AdamWFp8(ps, lr=1e-3))) < abs(expected)


def test_8bit_second_moment_with_a_zero_code_has_the_hazard():
    """The benchmark's ``lowbit_8bit_zero_map`` ablation (bitsandbytes' plain unsigned map,
    code 0 = 0) still decodes the repro's small v to 0 (the element jumped by -4.20 before the
    step clamped at Adam's own bound): it now moves by more than torch, up to that bound, where
    the zero-free map moves by less."""
    plain = harness.OPTIMIZERS["lowbit_8bit_zero_map"].build
    expected = repro_move(lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    moved = repro_move(lambda ps: plain(ps, lr=1e-3))
    assert 1.1 * abs(expected) < abs(moved) <= 1e-3 * (adam_bound(1) + adam_bound(2)) * (1 + 1e-6)
    assert abs(repro_move(lambda ps: AdamW8bit(ps, lr=1e-3))) < abs(expected)


MAGNITUDES = st.sampled_from([0.0, 1e-30, 1e-12, 1e-8, 1e-4, 1e-2, 1.0, 1e4, 1e12])


@st.composite
def gradient_sequences(draw):
    """A few steps of one 128-element block: tiny and huge magnitudes side by side, whole
    steps of zeros (a dead unit, an embedding row not in the batch), sign flips."""
    steps = draw(st.integers(2, 6))
    sequence = []
    for _ in range(steps):
        if draw(st.booleans()) and sequence:
            sequence.append([0.0] * 8)
            continue
        magnitudes = draw(st.lists(MAGNITUDES, min_size=8, max_size=8))
        signs = draw(st.lists(st.sampled_from([-1.0, 1.0]), min_size=8, max_size=8))
        sequence.append([m * s for m, s in zip(magnitudes, signs)])
    return sequence


@pytest.mark.parametrize("cls", [*OPTIMIZERS, EDGES_KEPT_8BIT], ids=lambda c: c.__name__)
@settings(max_examples=40, deadline=None)
@given(sequence=gradient_sequences())
def test_no_update_exceeds_adams_bound(cls, sequence):
    """Each of 8 patterns repeated over a 128-element block (so every block holds every
    magnitude); lr 1, no weight decay: the move of every element at every step stays within
    Adam's bound times the quantization allowance."""
    param = torch.nn.Parameter(torch.zeros(8, 16))
    optimizer = cls([param], lr=1.0, betas=BETAS, weight_decay=0.0, min_quant_size=0,
                    block_size=128, backend="eager")
    for step, values in enumerate(sequence, start=1):
        before = param.detach().clone()
        param.grad = torch.tensor(values).repeat_interleave(16).view(8, 16)
        optimizer.step()
        moved = (param.detach() - before).abs().max().item()
        bound = QUANTIZATION_ALLOWANCE * adam_bound(step)
        assert moved <= bound, (step, moved, bound)


def test_zero_point_repro_on_a_factored_weight_moves_at_most_ten_times_torch():
    """The repro on a 64 x 64 weight, whose second moment AdamWFactored4bit factors: the
    small element's factored v comes from its row and column, not from its own gradient."""
    def run(make):
        param = torch.nn.Parameter(torch.zeros(64, 64))
        optimizer = make([param])
        grad = torch.full((4096,), 1e-4)
        grad[::256] = 1.0
        for step_grad in (grad, torch.zeros(4096)):
            param.grad = step_grad.clone().view(64, 64)
            optimizer.step()
        assert not isinstance(optimizer, AdamWFactored4bit) or isinstance(
            optimizer.state[param]["exp_avg_sq"], FactoredState)
        return param.view(-1)[1].item()

    expected = run(lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    actual = run(lambda ps: AdamWFactored4bit(ps, lr=1e-3))
    assert abs(actual) <= 10 * abs(expected), (actual, expected)
    assert actual < 0, "still moves against the gradient"


@settings(max_examples=40, deadline=None)
@given(sequence=gradient_sequences(), spread=st.sampled_from([0.0, 1e-6, 1.0]))
def test_factored_updates_stay_within_adams_own_bound(sequence, spread):
    """The same adversarial magnitudes on a factored 16 x 64 weight, placed block-diagonally
    (row i carries its pattern in columns 4i..4i+3, ``spread`` times it elsewhere): an
    identity-like gradient, whose factored second moment underestimates the diagonal
    elements' own by up to 16x. The ratio is clamped at Adam's own bound, so every element
    moves by at most that bound (lr 1, no weight decay; float rounding 1e-5), with no
    quantization allowance: the clamp applies to the float first moment of the step."""
    param = torch.nn.Parameter(torch.zeros(16, 64))
    optimizer = AdamWFactored4bit([param], lr=1.0, betas=BETAS, weight_decay=0.0, min_quant_size=0,
                                  backend="eager")
    diagonal = torch.eye(16).repeat_interleave(4, dim=1)
    for step, values in enumerate(sequence, start=1):
        before = param.detach().clone()
        magnitudes = torch.tensor(values).repeat(2)[:, None]
        param.grad = magnitudes * (diagonal + spread * (1 - diagonal))
        optimizer.step()
        assert isinstance(optimizer.state[param]["exp_avg_sq"], FactoredState)
        moved = (param.detach() - before).abs().max().item()
        assert moved <= adam_bound(step) * (1 + 1e-5), (step, moved, adam_bound(step))


@pytest.mark.parametrize("cls, plain_format", [(AdamW8bit, "dynamic8-unsigned"), (AdamWFp8, "float8-e4m3")],
                         ids=lambda value: getattr(value, "__name__", value))
def test_checkpoint_saved_before_the_zero_free_map_loads_and_keeps_its_codes(cls, plain_format):
    """A checkpoint whose second moments are in the plain format of the zero-free one (an
    AdamW8bit checkpoint from before the zero-free map: ``dynamic8-unsigned``; a float8 state in the plain
    ``float8-e4m3`` format) loads as it is: codes and scales unchanged, the format relabelled (only code 0
    now reads as half the smallest value instead of 0), and training goes on."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(64, 80))
    optimizer = cls([param])
    for _ in range(2):
        param.grad = torch.randn_like(param)
        optimizer.step()
    saved = optimizer.state_dict()
    new = saved["state"][0]["exp_avg_sq"]
    saved["state"][0]["exp_avg_sq"] = QuantizedState(new.codes.clone(), new.scales.clone(),
                                                     plain_format, new.shape, new.dtype)
    resumed = cls([param])
    resumed.load_state_dict(saved)
    state = resumed.state[param]["exp_avg_sq"]
    assert state.format_name == cls.exp_avg_sq_format.name == f"{plain_format}-nonzero"
    assert torch.equal(state.codes, saved["state"][0]["exp_avg_sq"].codes)
    assert torch.equal(state.scales, saved["state"][0]["exp_avg_sq"].scales)
    param.grad = torch.randn_like(param)
    resumed.step()
    assert torch.isfinite(param).all()

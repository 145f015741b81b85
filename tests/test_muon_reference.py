"""The reference Muon (lowbit_optim.reference.muon) against torch.optim.Muon, and the momentum
codecs it is studied with (lowbit_optim.reference.momentum_codecs)."""

import pytest
import torch

from lowbit_optim.formats import catalog
from lowbit_optim.reference import momentum_codecs as codecs
from lowbit_optim.reference.muon import ReferenceMuon

# A tall and a wide matrix: Newton-Schulz transposes the tall one.
SHAPES = ((12, 8), (8, 20))
STEPS = 4


def run(make_optimizer, *, steps=STEPS, seed=0):
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator) * 0.1) for shape in SHAPES]
    optimizer = make_optimizer(params)
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()
    return params, optimizer


@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "plain"])
@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw"])
def test_reference_muon_with_float_momentum_equals_torch_muon_bit_for_bit(adjust_lr_fn, nesterov):
    if not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon arrived in torch 2.9")
    hyper = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    expected, torch_muon = run(lambda params: torch.optim.Muon(params, **hyper))
    actual, ours = run(lambda params: ReferenceMuon(params, **hyper))
    for want, got in zip(expected, actual):
        assert torch.equal(got, want)
        assert torch.equal(ours.state[got]["momentum_buffer"], torch_muon.state[want]["momentum_buffer"])


def test_reference_muon_with_4bit_momentum_leaves_the_float_trajectory():
    """Sensitivity control: the comparison above can tell a quantized momentum apart."""
    float_params, _ = run(lambda params: ReferenceMuon(params, lr=0.02))
    quantized = codecs.BlockwiseMomentum(catalog.DYNAMIC_4BIT_SIGNED, 16)
    quantized_params, _ = run(lambda params: ReferenceMuon(params, lr=0.02, codec=quantized))
    assert not torch.equal(quantized_params[0], float_params[0])


def test_reference_muon_refuses_a_1d_parameter_and_an_unknown_lr_adjustment():
    with pytest.raises(ValueError, match=r"2-D parameters only, got one of shape \(5,\)"):
        ReferenceMuon([torch.nn.Parameter(torch.zeros(5))])
    with pytest.raises(ValueError, match="'sqrt'"):
        ReferenceMuon([torch.nn.Parameter(torch.zeros(2, 2))], adjust_lr_fn="sqrt")


def test_rotated_blockwise_momentum_decodes_its_own_codes_exactly_as_unrotated_values():
    """The random-sign Hadamard rotation is undone on decode: a block whose rotated values sit
    on codes comes back to within float32 rounding of the rotation."""
    codec = codecs.BlockwiseMomentum(codecs.LINEAR_4BIT_SIGNED, 16, rotate=True)
    param = torch.zeros(4, 8)
    state = codec.init(param)
    momentum = torch.randn(4, 8)
    decoded_once = codec.decode(codec.encode(momentum, state))
    decoded_twice = codec.decode(codec.encode(decoded_once, state))
    torch.testing.assert_close(decoded_twice, decoded_once, rtol=0, atol=1e-6)
    assert not torch.allclose(decoded_once, momentum, atol=1e-3)


def test_stochastic_rounding_of_momentum_codes_is_unbiased():
    codec = codecs.BlockwiseMomentum(catalog.DYNAMIC_4BIT_SIGNED, 16, stochastic_rounding=True)
    # Each block's largest magnitude positive: the signed dynamic map reaches +1 but only -0.8875.
    momentum = torch.linspace(-0.8, 1, 16).view(2, 8)
    state = codec.init(momentum)
    mean = torch.stack([codec.decode(codec.encode(momentum, state)) for _ in range(2000)]).mean(0)
    nearest = codecs.BlockwiseMomentum(catalog.DYNAMIC_4BIT_SIGNED, 16)
    nearest_error = (nearest.decode(nearest.encode(momentum, state)) - momentum).abs().max()
    assert (mean - momentum).abs().max() < nearest_error / 4


@pytest.mark.parametrize(("codec", "bytes_per_param"), [
    (codecs.FloatMomentum(), 4.0),
    (codecs.BlockwiseMomentum(catalog.DYNAMIC_8BIT_SIGNED, 256), 1 + 4 / 256),
    (codecs.BlockwiseMomentum(codecs.LINEAR_8BIT_SIGNED, 2048), 1 + 4 / 2048),
    (codecs.BlockwiseMomentum(catalog.DYNAMIC_4BIT_SIGNED, 32), 0.5 + 4 / 32),
    (codecs.BlockwiseMomentum(codecs.NORMAL_4BIT, 128, rotate=True), 0.5 + 4 / 128 + 16 / 2**20),
    (codecs.ErrorFeedbackMomentum(codecs.BlockwiseMomentum(catalog.DYNAMIC_4BIT_SIGNED, 128),
                                  codecs.FloatMomentum(torch.bfloat16)), 0.5 + 4 / 128 + 2),
], ids=["fp32", "dynamic8-256", "linear8-2048", "dynamic4-32", "rotated-normal4-128", "ef-bf16"])
def test_momentum_state_bytes_per_param_on_a_1024_square_weight(codec, bytes_per_param):
    state = codec.init(torch.zeros(1024, 1024))
    assert codec.state_bytes(state) / 1024**2 == pytest.approx(bytes_per_param, rel=1e-12)

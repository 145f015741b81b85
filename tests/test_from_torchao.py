"""A checkpoint of torchao's low-bit optimizer resumes in ours (issue 15), with real torchao:
each of its AdamW8bit, AdamW4bit, AdamWFp8, Adam8bit, Adam4bit and AdamFp8 into our class of the
same name."""

import io

import pytest
import torch

from lowbit_optim import Adam4bit, Adam8bit, AdamFp8, AdamW4bit, AdamW8bit, AdamWFp8, QuantizedState
from lowbit_optim.checkpoint import foreign_float_values

torchao_optim = pytest.importorskip("torchao.optim")

PAIRS = {
    "AdamW8bit": (torchao_optim.AdamW8bit, AdamW8bit),
    "AdamW4bit": (torchao_optim.AdamW4bit, AdamW4bit),
    "Adam8bit": (torchao_optim.Adam8bit, Adam8bit),
    "Adam4bit": (torchao_optim.Adam4bit, Adam4bit),
    "AdamWFp8": (torchao_optim.AdamWFp8, AdamWFp8),
    "AdamFp8": (torchao_optim.AdamFp8, AdamFp8),
}
STEPS = 3


def saved_and_loaded(state_dict):
    """Through a file, as users move checkpoints (torchao's classes must be importable)."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("name", PAIRS)
def test_torchao_checkpoint_resumes_in_ours(name):
    torchao_cls, our_cls = PAIRS[name]
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(64, 128))  # quantized by both (8192 elements)
    bias = torch.nn.Parameter(torch.randn(64))  # float32 state in both
    grads = [(torch.randn(64, 128), torch.randn(64)) for _ in range(STEPS + 1)]
    theirs = torchao_cls([weight, bias], lr=1e-2, weight_decay=0.1)
    for weight_grad, bias_grad in grads[:STEPS]:
        weight.grad, bias.grad = weight_grad.clone(), bias_grad.clone()
        theirs.step()
    checkpoint = saved_and_loaded(theirs.state_dict())
    saved_moments = {key: foreign_float_values(checkpoint["state"][0][key])
                     for key in ("exp_avg", "exp_avg_sq")}

    ours = our_cls([weight, bias], lr=1.0)  # the checkpoint's hyperparameters win
    ours.load_state_dict(checkpoint)
    group = ours.param_groups[0]
    assert float(group["lr"]) == pytest.approx(1e-2) and group["weight_decay"] == 0.1
    assert group["maximize"] is False and group["block_size"] == our_cls.exp_avg_format.default_block_size
    state = ours.state[weight]
    assert state["step"].item() == STEPS
    for key, values in saved_moments.items():
        # Their dequantized values, quantized once in our format.
        expected = QuantizedState.from_float(values, ours.moment_format(key), group["block_size"])
        assert torch.equal(state[key].codes, expected.codes)
        assert torch.equal(state[key].scales, expected.scales)
    assert torch.equal(ours.state[bias]["exp_avg"], checkpoint["state"][1]["exp_avg"].float())

    # Training continues where torchao's would have gone, to the moments' quantization noise.
    start = weight.detach().clone()
    moved = []
    for optimizer in (theirs, ours):
        with torch.no_grad():
            weight.copy_(start)
        weight.grad, bias.grad = grads[STEPS][0].clone(), grads[STEPS][1].clone()
        optimizer.step()
        moved.append(weight.detach() - start)
    relative = float((moved[1] - moved[0]).norm() / moved[0].norm())
    # One step moves each weight by about lr; the two moments' roundings (ours after theirs)
    # bound the difference: ~1% of the update at 8 bits, ~10% at 4 bits (tests/test_optimizer.py).
    assert relative < 0.2, relative

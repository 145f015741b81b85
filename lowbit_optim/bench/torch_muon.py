"""``torch.optim.Muon`` for the hidden matrices and fp32 ``torch.optim.AdamW`` for the rest, as
one optimizer: the reference the benchmark compares ``Muon8bit`` and ``Muon4bit`` with (the same
split, one scheduler driving both parts, one ``state`` for the memory columns)."""

import torch


class TorchMuonWithAdamW(torch.optim.Optimizer):
    """The two torch optimizers' param groups (the same dicts, so a scheduler that sets
    ``group["lr"]`` sets theirs) and state, stepped one after the other. For benchmarking:
    ``load_state_dict`` would replace the shared state, so it is not meant to resume."""

    def __init__(self, muon_params, adamw_params, *, lr: float, betas: tuple[float, float],
                 weight_decay: float, adjust_lr_fn: str | None):
        self.muon = torch.optim.Muon(muon_params, lr=lr, weight_decay=weight_decay,
                                     adjust_lr_fn=adjust_lr_fn)
        self.adamw = torch.optim.AdamW(adamw_params, lr=lr, betas=betas, weight_decay=weight_decay,
                                       fused=True)
        super().__init__([*self.muon.param_groups, *self.adamw.param_groups], {})
        self.muon.state = self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): tracer's reference
implementation, since torch has none. It runs for real (on fake tensors during a capture), so the
capture records its ops and state like any torch optimizer's.

One state tensor per parameter, `exp_avg` (the momentum, the parameter's dtype and shape). Per parameter,
one step makes one temporary of the parameter's size (the interpolated update, signed in place):

    update = sign(beta1 * m + (1 - beta1) * g);  p *= 1 - lr * wd;  p -= lr * update
    m = beta2 * m + (1 - beta2) * g

Not modelled: a foreach (multi-tensor) variant (--foreach has no effect on it).
"""
from __future__ import annotations

import torch


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0):
        if lr < 0.0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Lion: invalid lr {lr} or betas {betas}")
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                exp_avg = state["exp_avg"]
                update = exp_avg.lerp(p.grad, 1.0 - beta1).sign_()      # one parameter-sized temporary
                if group["weight_decay"]:
                    p.mul_(1.0 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"])
                del update
                exp_avg.lerp_(p.grad, 1.0 - beta2)
        return loss

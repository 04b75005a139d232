"""The supervised loop the picture recipes share (`tiny-shapes`, `tiny-count`): AdamW with a linear warm-up, gradients
clipped at 1, one loss a step, a transient progress bar. Torch is imported here, so `assay.recipes.build` imports this
module only once it has pinned the kernels."""

from __future__ import annotations

from typing import Any, Callable

import torch

from assay.training.precision import warmup


def fit(model, train: dict[str, Any], name: str, loss_at: Callable[[int], torch.Tensor]) -> None:
    """Train `model` for `train["steps"]` steps on `loss_at(step)` with AdamW (`lr`, `weight_decay`, `warmup` from `train`)."""
    from rich.progress import Progress

    opt = torch.optim.AdamW(model.parameters(), lr=train["lr"], weight_decay=train.get("weight_decay", 0.0))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup(train.get("warmup", 0)))
    model.train()
    with Progress(transient=True) as bar:
        job = bar.add_task(f"pretrain {name}", total=train["steps"])
        for step in range(train["steps"]):
            loss = loss_at(step)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            bar.update(job, completed=step + 1, description=f"pretrain {name} loss {loss.item():.4f}")
    model.eval()

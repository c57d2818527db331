"""A resumable training stage: checkpoints, a progress bar and a loss history.

Invariant: a stage stopped anywhere and run again ends with the same weights as one run straight
through. Each step draws its randomness from a generator seeded by (recipe seed, stage, step), not
from the process's global state, and the checkpoint holds every module, the optimiser and the
losses; the learning rate is a function of the step.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm


class RecipeMismatchError(ValueError):
    """A checkpoint was made by another recipe; resuming from it would mix two runs."""


@dataclass
class Stage:
    """One model's training: ``step_fn(step, generator)`` runs an optimiser step, returns the
    loss. ``modules`` are checkpointed with ``optimizer`` (an EMA copy, say)."""

    name: str
    steps: int
    lr: float
    warmup_steps: int
    optimizer: torch.optim.Optimizer
    modules: dict[str, torch.nn.Module]
    step_fn: Callable[[int, torch.Generator], float]
    fingerprint: str  # the recipe fields this stage depends on
    losses: list[float] = field(default_factory=list)


def learning_rate(step: int, peak: float, warmup: int, total: int) -> float:
    """Linear warm-up to ``peak``, then cosine decay to a tenth of it at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def step_generator(seed: int, stage: str, step: int) -> torch.Generator:
    """The generator of one step: the same (seed, stage, step) always draws the same numbers."""
    offset = sum(ord(char) for char in stage) * 1_000_003
    return torch.Generator().manual_seed(seed * 7_919_000_009 + offset + step)


def _save(stage: Stage, path: Path, step: int) -> None:
    state = {
        "fingerprint": stage.fingerprint,
        "step": step,
        "losses": stage.losses,
        "optimizer": stage.optimizer.state_dict(),
        "modules": {name: module.state_dict() for name, module in stage.modules.items()},
    }
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    torch.save(state, partial)
    os.replace(partial, path)  # a reader sees the old checkpoint or the new one, never half


def _resume(stage: Stage, path: Path) -> int:
    """The step to start from: 0 without a checkpoint, else the checkpoint's (state restored)."""
    if not path.is_file():
        return 0
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state["fingerprint"] != stage.fingerprint:
        raise RecipeMismatchError(
            f"{path} was trained with another recipe: delete the work directory or use another"
        )
    for name, module in stage.modules.items():
        module.load_state_dict(state["modules"][name])
    stage.optimizer.load_state_dict(state["optimizer"])
    stage.losses = list(state["losses"])
    return int(state["step"])


def run_stage(
    stage: Stage, workdir: Path, seed: int, checkpoint_every: int, progress: bool = True
) -> list[float]:
    """Train ``stage`` to its last step, resuming from ``workdir/<name>.ckpt``; returns the
    losses of every step."""
    path = Path(workdir) / f"{stage.name}.ckpt"
    path.parent.mkdir(parents=True, exist_ok=True)
    start = _resume(stage, path)
    bar = tqdm(total=stage.steps, initial=start, desc=f"train {stage.name}", unit="step")
    bar.disable = not progress
    for step in range(start, stage.steps):
        for group in stage.optimizer.param_groups:
            group["lr"] = learning_rate(step, stage.lr, stage.warmup_steps, stage.steps)
        loss = stage.step_fn(step, step_generator(seed, stage.name, step))
        if not math.isfinite(loss):
            raise FloatingPointError(f"{stage.name} loss became {loss} at step {step}")
        stage.losses.append(loss)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}")
        if (step + 1) % checkpoint_every == 0 or step + 1 == stage.steps:
            _save(stage, path, step + 1)
    bar.close()
    return stage.losses

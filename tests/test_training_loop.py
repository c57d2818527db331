"""The resumable training loop: a stopped stage resumes to the weights of a run straight through."""

from __future__ import annotations

import pytest
import torch

from backend.training.loop import (
    RecipeMismatchError,
    Stage,
    learning_rate,
    run_stage,
    step_generator,
)


def _stage(steps: int = 6, fingerprint: str = "recipe-a", stop_at: int | None = None) -> Stage:
    """A linear model fitted to random targets; ``stop_at`` raises at that step (a Ctrl-C)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)

    def step(index: int, generator: torch.Generator) -> float:
        if index == stop_at:
            raise KeyboardInterrupt
        inputs = torch.randn(8, 4, generator=generator)
        loss = (model(inputs) - inputs[:, :2]).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    return Stage("toy", steps, 0.1, 2, optimizer, {"model": model}, step, fingerprint)


def _weights(stage: Stage) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in stage.modules["model"].parameters()])


def test_a_stopped_stage_resumes_to_the_weights_of_a_straight_run(tmp_path):
    straight = _stage()
    straight_losses = run_stage(straight, tmp_path / "straight", 0, 2, progress=False)
    with pytest.raises(KeyboardInterrupt):
        run_stage(_stage(stop_at=5), tmp_path / "stopped", 0, 2, progress=False)
    resumed = _stage()
    resumed_losses = run_stage(resumed, tmp_path / "stopped", 0, 2, progress=False)
    assert torch.equal(_weights(resumed), _weights(straight))
    assert resumed_losses == straight_losses and len(resumed_losses) == 6


def test_a_finished_stage_is_not_trained_again(tmp_path):
    first = _stage()
    run_stage(first, tmp_path, 0, 2, progress=False)
    again = _stage(stop_at=0)  # would raise if any step ran
    run_stage(again, tmp_path, 0, 2, progress=False)
    assert torch.equal(_weights(again), _weights(first))


def test_a_checkpoint_of_another_recipe_is_refused(tmp_path):
    run_stage(_stage(), tmp_path, 0, 2, progress=False)
    with pytest.raises(RecipeMismatchError, match="another recipe"):
        run_stage(_stage(fingerprint="recipe-b"), tmp_path, 0, 2, progress=False)


def test_a_diverging_loss_stops_the_run_with_the_step(tmp_path):
    stage = _stage()
    stage.step_fn = lambda index, generator: float("nan")
    with pytest.raises(FloatingPointError, match="step 0"):
        run_stage(stage, tmp_path, 0, 2, progress=False)


def test_each_step_draws_its_own_numbers():
    first = torch.rand(3, generator=step_generator(0, "unet", 7))
    assert torch.equal(first, torch.rand(3, generator=step_generator(0, "unet", 7)))
    assert not torch.equal(first, torch.rand(3, generator=step_generator(0, "unet", 8)))
    assert not torch.equal(first, torch.rand(3, generator=step_generator(0, "vae", 7)))
    assert not torch.equal(first, torch.rand(3, generator=step_generator(1, "unet", 7)))


def test_the_learning_rate_warms_up_then_decays_to_a_tenth():
    rates = [learning_rate(step, 1.0, 10, 100) for step in range(100)]
    assert rates[0] == pytest.approx(0.1) and rates[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(rates[9:], rates[10:]))
    assert learning_rate(100, 1.0, 10, 100) == pytest.approx(0.1)

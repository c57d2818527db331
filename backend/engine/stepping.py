"""Scheduler updates of a whole batch in one set of tensor ops.

After the forward pass every row needs classifier-free guidance and its scheduler's update. Done
row by row through diffusers (``scheduler.step``) that is a dozen tiny ops and Python calls per
row, which on small models is most of the batching overhead of a step. Here the rows are stacked
and updated together, with each row's own sigmas (rows sit at different steps).

Supported exactly: ``EulerDiscreteScheduler`` without churn (epsilon, v_prediction or sample
prediction) and ``FlowMatchEulerDiscreteScheduler`` without stochastic sampling. Invariant: the
same float32 operations in the same order as the diffusers ``step`` of each row, so the result is
bit-identical to stepping rows one at a time (tested against diffusers); ``advance_step_indices``
then moves every row's scheduler to its next step. ``batched_step`` returns None for anything
else and the caller steps rows one by one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from backend.engine.host import to_device

_EULER = "EulerDiscreteScheduler"
_FLOW = "FlowMatchEulerDiscreteScheduler"


def guide_all(
    prediction: torch.Tensor, halves: Sequence[int], guidance: Sequence[float]
) -> torch.Tensor:
    """Classifier-free guidance of a batch whose rows are ``halves[i]`` consecutive predictions
    (uncond, cond) each: one guided row per request. Equals ``uncond + g * (cond - uncond)`` per
    row."""
    if all(h == 1 for h in halves):
        return prediction
    if any(h != 2 for h in halves):
        raise ValueError(f"guidance needs 1 or 2 halves per request, got {sorted(set(halves))}")
    pairs = prediction.view(len(halves), 2, *prediction.shape[1:])
    uncond, cond = pairs[:, 0], pairs[:, 1]
    scale = to_device(torch.tensor(guidance, dtype=prediction.dtype), prediction.device)
    return uncond + scale.view(-1, *[1] * (prediction.dim() - 1)) * (cond - uncond)


def _supported(schedulers: Sequence) -> str | None:
    names = {type(s).__name__ for s in schedulers}
    if (
        len(names) != 1
        or not names <= {_EULER, _FLOW}
        or any(s.step_index is None for s in schedulers)
    ):
        return None
    name = names.pop()
    config = schedulers[0].config
    if name == _EULER and config.prediction_type in (
        "epsilon",
        "v_prediction",
        "sample",
        "original_sample",
    ):
        return (
            name
            if all(s.config.prediction_type == config.prediction_type for s in schedulers)
            else None
        )
    if name == _FLOW and not getattr(config, "stochastic_sampling", False):
        return name
    return None


def _sigmas(schedulers: Sequence, offset: int, like: torch.Tensor) -> torch.Tensor:
    values = torch.stack([s.sigmas[s.step_index + offset] for s in schedulers])
    on_device = to_device(values.to(torch.float32), like.device)
    return on_device.view(-1, *[1] * (like.dim() - 1))


def batched_step(
    schedulers: Sequence, model_output: torch.Tensor, samples: torch.Tensor
) -> torch.Tensor | None:
    """The next samples of every row (row i: ``schedulers[i]``, ``model_output[i]``,
    ``samples[i]``), or None when these schedulers are not supported (nothing is changed then)."""
    kind = _supported(schedulers)
    if kind is None:
        return None
    sample = samples.to(torch.float32)
    sigma, sigma_next = _sigmas(schedulers, 0, sample), _sigmas(schedulers, 1, sample)
    if kind == _FLOW:
        prev = sample + (sigma_next - sigma) * model_output
    else:
        sigma_hat = sigma * 1.0  # churn 0: gamma = 0, as diffusers computes it
        prediction_type = schedulers[0].config.prediction_type
        if prediction_type == "epsilon":
            original = sample - sigma_hat * model_output
        elif prediction_type == "v_prediction":
            original = model_output * (-sigma / (sigma**2 + 1) ** 0.5) + (sample / (sigma**2 + 1))
        else:
            original = model_output
        derivative = (sample - original) / sigma_hat
        prev = sample + derivative * (sigma_next - sigma_hat)
    return prev.to(model_output.dtype)


def advance_step_indices(schedulers: Sequence) -> None:
    """After ``batched_step``'s samples are taken: every row's scheduler moves to its next step
    (apart, so a caller makes every new tensor before it changes any state)."""
    for scheduler in schedulers:
        scheduler._step_index += 1

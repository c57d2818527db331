"""Vectorised guidance and scheduler updates equal diffusers' per-row ``step`` bit for bit."""

from __future__ import annotations

import pytest
import torch
from diffusers import DDIMScheduler, EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler

from backend.engine.stepping import advance_step_indices, batched_step, guide_all
from backend.models.configs import SCHEDULERS

STEPS = 10
AT_STEPS = (0, 3, 7, 9)  # rows at different steps, the last one finishing


def euler(prediction_type: str):
    scheduler = EulerDiscreteScheduler(
        **{**SCHEDULERS["sd2-inpaint"], "prediction_type": prediction_type}
    )
    scheduler.set_timesteps(STEPS)
    return scheduler


def flow():
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULERS["flux-fill"])
    scheduler.set_timesteps(STEPS, mu=0.8)
    return scheduler


def at_step(make, step: int):
    scheduler = make()
    scheduler._step_index = step
    return scheduler


@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda: euler("epsilon"), (1, 4, 8, 8)),
        (lambda: euler("v_prediction"), (1, 4, 8, 8)),
        (flow, (1, 16, 64)),
    ],
)
def test_a_batched_step_equals_each_rows_own_diffusers_step(make, shape):
    generator = torch.Generator().manual_seed(0)
    outputs = [torch.randn(shape, generator=generator) for _ in AT_STEPS]
    samples = [torch.randn(shape, generator=generator) for _ in AT_STEPS]
    expected = []
    for step, output, sample in zip(AT_STEPS, outputs, samples):
        scheduler = at_step(make, step)
        expected.append(
            scheduler.step(output, scheduler.timesteps[step], sample, return_dict=False)[0]
        )
    schedulers = [at_step(make, step) for step in AT_STEPS]
    result = batched_step(schedulers, torch.cat(outputs), torch.cat(samples))
    assert torch.equal(result, torch.cat(expected))
    assert [s.step_index for s in schedulers] == list(AT_STEPS)  # unmoved until told
    advance_step_indices(schedulers)
    assert [s.step_index for s in schedulers] == [step + 1 for step in AT_STEPS]


def test_unsupported_schedulers_are_left_to_the_row_by_row_path():
    ddim = DDIMScheduler(
        **{k: v for k, v in SCHEDULERS["sd2-inpaint"].items() if k != "timestep_spacing"}
    )
    ddim.set_timesteps(STEPS)
    ddim._step_index = 2
    assert batched_step([ddim], torch.zeros(1, 4, 8, 8), torch.zeros(1, 4, 8, 8)) is None
    mixed = [at_step(lambda: euler("epsilon"), 1), at_step(flow, 1)]
    assert batched_step(mixed, torch.zeros(2, 4), torch.zeros(2, 4)) is None
    assert [s.step_index for s in mixed] == [1, 1]  # untouched
    not_started = euler("epsilon")  # step index unset until the first scale_model_input
    assert batched_step([not_started], torch.zeros(1, 4), torch.zeros(1, 4)) is None


def test_guidance_of_a_batch_equals_per_row_guidance():
    generator = torch.Generator().manual_seed(1)
    prediction = torch.randn(6, 4, 8, 8, generator=generator)
    scales = [7.5, 1.0, 3.0]
    guided = guide_all(prediction, [2, 2, 2], scales)
    for row, scale in enumerate(scales):
        uncond, cond = prediction[2 * row : 2 * row + 2].chunk(2)
        assert torch.equal(guided[row : row + 1], uncond + scale * (cond - uncond))
    assert guide_all(prediction, [1] * 6, [0.0] * 6) is prediction
    with pytest.raises(ValueError, match="1 or 2 halves"):
        guide_all(prediction, [3, 3], [1.0, 1.0])

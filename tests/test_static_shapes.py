"""Bucketed (static-shape) steps: the bucket rules, the layouts they build, and the engine's
bucketed step against its exact one on the tiny models of every family, both cache modes, mixed
batches and rows with adapters (CPU, float32).

Token buckets change no value: a repeated token computes what the token it repeats computes, so
a bucketed step of 1, 2 or 4 requests equals the exact step within 1e-6. Row buckets add requests,
and the convolutions of a larger batch take other kernels on this CPU: a step of 3 requests run as
4 agrees with the exact one to float32 rounding (``ROW_PADDED_TOL``, relative to the largest
prediction).
"""

from __future__ import annotations

import pytest
import torch

from backend.bench.synthetic_lora import peft_adapter
from backend.engine.buckets import (
    buckets_steps,
    check_step_shapes,
    row_bucket,
    token_bucket,
)
from backend.engine.host import to_device_together
from backend.engine.layout import RowPlaces, bucketed_layout, make_layout, row_tokens
from backend.engine.step_layouts import LayoutMemo
from tests.factories import FAMILIES, full_mask, make_engine, make_params, make_template, rect_mask

TOKEN_TOL = 1e-6
ROW_PADDED_TOL = 1e-5
PROMPTS = ("a blue vase", "a cat", "a dog", "a red chair")
MASKS = (
    rect_mask((32, 40, 96, 80)),
    rect_mask((0, 0, 48, 128)),
    rect_mask((96, 96, 128, 120)),
    rect_mask((8, 8, 40, 120)),
)


# ----- the rules ------------------------------------------------------------------------------
def test_token_buckets_hold_every_count_with_at_most_a_quarter_more():
    for num_tokens in (1, 7, 64, 300, 4096):
        previous = 0
        for count in range(1, num_tokens + 1):
            bucket = token_bucket(count, num_tokens)
            assert count <= bucket <= num_tokens
            assert bucket <= max(8, count * 1.25) or bucket == num_tokens
            assert bucket >= previous  # monotonic: a batch's bucket is its longest row's
            previous = bucket
    buckets = sorted({token_bucket(n, 64) for n in range(1, 65)})
    assert buckets == [*range(1, 9), 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64]
    # a 512 px SD2 grid: few shapes to compile
    assert len({token_bucket(n, 4096) for n in range(1, 4097)}) == 44


def test_row_buckets_are_powers_of_two():
    assert [row_bucket(n) for n in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, 16]


@pytest.mark.parametrize(
    "call, message",
    (
        (lambda: row_bucket(0), "at least one request"),
        (lambda: token_bucket(0, 64), "1 to 64 tokens"),
        (lambda: token_bucket(65, 64), "1 to 64 tokens"),
        (lambda: token_bucket(9, 64, per_octave=3), "power of two"),
        (lambda: check_step_shapes("static"), "auto, exact, bucketed"),
    ),
)
def test_bad_bucket_arguments_are_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_auto_buckets_on_cuda_only():
    assert buckets_steps("auto", "cuda") and not buckets_steps("auto", "cpu")
    assert buckets_steps("bucketed", "cpu") and not buckets_steps("exact", "cuda")


# ----- layouts --------------------------------------------------------------------------------
def _mask(num_tokens: int, *selected: int) -> torch.Tensor:
    mask = torch.zeros(num_tokens, dtype=torch.bool)
    mask[list(selected)] = True
    return mask


def test_a_bucketed_layout_holds_each_row_then_repeats_its_last_token():
    first, second = _mask(12, 0, 1, 2), _mask(12, 3, 5, 6, 7, 11)
    rows = [row_tokens(m, 12, "cpu") for m in (first, first, second, second)]
    layout = bucketed_layout(rows, 6, RowPlaces("cpu"))
    exact = make_layout([first, first, second, second])
    assert layout.offsets == (0, 6, 12, 18, 24) and layout.counts == (3, 3, 5, 5)
    assert layout.groups == exact.groups == ((0, 2), (2, 4))
    assert layout.indices[0].tolist() == [0, 1, 2, 2, 2, 2]
    assert layout.indices[3].tolist() == [3, 5, 6, 7, 11, 11]
    assert layout.flat_index.tolist()[:6] == [0, 1, 2, 2, 2, 2]
    assert layout.flat_index.tolist()[18:] == [39, 41, 42, 43, 47, 47]
    assert layout.row_of_token.tolist() == [r for r in range(4) for _ in range(6)]
    assert layout.padded_index is None and layout.every_row_partial and not layout.is_full


def test_a_row_padded_to_every_token_still_reads_its_cache():
    """A partial row beside a full one is padded to the whole grid, yet it is not full."""
    rows = [row_tokens(_mask(8, 2, 3), 8, "cpu"), row_tokens(None, 8, "cpu")]
    layout = bucketed_layout(rows, 8, RowPlaces("cpu"))
    assert layout.indices[0].numel() == 8 and not layout.row_is_full(0) and layout.row_is_full(1)
    assert not layout.is_full and not layout.every_row_partial


def test_bucketed_layouts_refuse_rows_they_cannot_hold():
    places = RowPlaces("cpu")
    with pytest.raises(ValueError, match="cannot hold"):
        bucketed_layout([row_tokens(_mask(8, 1, 2, 3), 8, "cpu")], 2, places)
    with pytest.raises(ValueError, match="one token grid"):
        bucketed_layout([row_tokens(None, 8, "cpu"), row_tokens(None, 4, "cpu")], 8, places)
    with pytest.raises(ValueError, match="at least one token"):
        row_tokens(_mask(8), 8, "cpu")


def test_the_memo_builds_a_batch_layout_once():
    memo = LayoutMemo("cpu")
    rows = [row_tokens(_mask(16, 1, 2, 9), 16, "cpu"), row_tokens(_mask(16, 4), 16, "cpu")]
    first = memo.layout(rows)
    assert memo.layout(list(rows)) is first and memo.built == 1
    assert memo.layout(rows[::-1]) is not first and memo.built == 2


# ----- the engine -----------------------------------------------------------------------------
@pytest.fixture(scope="module", params=FAMILIES)
def engine(request, models_dir, tmp_path_factory):
    return make_engine(request.param, models_dir, tmp_path_factory.mktemp(f"cache-{request.param}"))


@pytest.fixture(scope="module")
def caches(engine):
    """Each mode's caches of two templates (rows of templates 7 and 8 read them)."""
    return {
        mode: [
            engine.prepare_template(make_template(seed), make_params(engine, mode=mode))
            for seed in (7, 8)
        ]
        for mode in ("kv", "hidden")
    }


def _predictions(engine, shapes: str, mode: str, rows, monkeypatch) -> torch.Tensor:
    """The guided prediction of one step of ``rows`` ((template seed, mask, cache, adapters)) run
    with ``shapes``."""
    monkeypatch.setattr(engine, "step_shapes", shapes)
    params = make_params(engine, mode=mode)
    states = [
        engine.start(make_template(t), m, PROMPTS[i], i, params, cache=c, adapters=a)
        for i, (t, m, c, a) in enumerate(rows)
    ]
    seen = []
    monkeypatch.setattr(engine, "_advance", lambda _states, prediction: seen.append(prediction))
    engine.step(states, mode)
    return seen[0]


def _difference(engine, mode, rows, monkeypatch) -> tuple[float, float]:
    exact = _predictions(engine, "exact", mode, rows, monkeypatch)
    bucketed = _predictions(engine, "bucketed", mode, rows, monkeypatch)
    assert bucketed.shape == exact.shape  # the added requests' predictions are dropped
    return (bucketed - exact).abs().max().item(), exact.abs().max().item()


@pytest.mark.model
@pytest.mark.parametrize("mode", ("kv", "hidden"))
def test_token_buckets_change_no_prediction(engine, caches, mode, monkeypatch):
    """Two requests with other templates and token counts, then one request beside a row that
    computes every token (both padded to the whole grid): no row padding, so within 1e-6."""
    first, second = caches[mode]
    for rows in (
        [(7, MASKS[0], first, ()), (8, MASKS[1], second, ())],
        [(7, MASKS[2], first, ()), (9, MASKS[3], None, ())],
        [(8, MASKS[3], second, ())],
    ):
        difference, _ = _difference(engine, mode, rows, monkeypatch)
        assert difference <= TOKEN_TOL


@pytest.mark.model
def test_row_buckets_change_predictions_only_by_rounding(engine, caches, monkeypatch):
    """Three requests (one computing every token) run as four."""
    first, second = caches["kv"]
    rows = [(7, MASKS[0], first, ()), (8, MASKS[1], second, ()), (9, MASKS[2], None, ())]
    difference, scale = _difference(engine, "kv", rows, monkeypatch)
    assert difference <= ROW_PADDED_TOL * scale


@pytest.mark.model
def test_rows_with_adapters_step_bucketed_as_exact(engine, caches, monkeypatch):
    targets = sorted(engine.adapters.targets)
    for seed, adapter_id in ((1, "b0"), (2, "b1")):
        if adapter_id not in engine.adapters:
            made = peft_adapter(engine.adapter.denoiser, adapter_id, seed, 4, 8.0, targets[::seed])
            engine.adapters.put(made.adapter)
    first, _ = caches["kv"]
    rows = [
        (7, MASKS[0], first, (("b0", 0.7),)),
        (7, MASKS[1], first, (("b0", 0.4), ("b1", 1.5))),
        (7, MASKS[3], first, ()),
        (7, full_mask(), None, (("b1", -0.8),)),
    ]
    difference, _ = _difference(engine, "kv", rows, monkeypatch)
    assert difference <= TOKEN_TOL


@pytest.mark.model
def test_a_continuous_batch_builds_its_layouts_once(engine, caches, monkeypatch):
    """Steps of the same rows reuse the layouts built at their first step: no layout is built and
    nothing is copied to the device (every request's tokens were placed when it was admitted)."""
    monkeypatch.setattr(engine, "step_shapes", "bucketed")
    params = make_params(engine, mode="kv")
    first, second = caches["kv"]
    states = [
        engine.start(make_template(7), MASKS[0], PROMPTS[0], 1, params, cache=first),
        engine.start(make_template(8), MASKS[1], PROMPTS[1], 2, params, cache=second),
    ]
    engine.step(states, "kv")
    memo = engine.layout_memo(states[0].latents.device)
    built = memo.built
    copies = []

    def counted(tensors, device):
        copies.append(len(tensors))
        return to_device_together(tensors, device)

    monkeypatch.setattr("backend.engine.layout.to_device_together", counted)
    engine.step(states, "kv")
    assert memo.built == built and copies == []
    engine.step(states[:1], "kv")  # another composition: its layouts are built anew
    assert memo.built > built

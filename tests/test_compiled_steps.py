"""Compiled steps and the operators a bucketed step launches, on the tiny models (CPU).

Each family's whole mask-aware forward compiles as one graph (``fullgraph=True``: a graph break
would raise) and the compiled step equals the eager one; a step of other masks in the same
buckets replays that graph. Dense and recording steps run compiled too. The bucketed mask-aware
step launches no more operators than the dense step of the same rows
(``backend.engine.launches``). Compiling costs seconds to a minute here, so the compile tests are
few and marked slow.
"""

from __future__ import annotations

import pytest
import torch

from backend.cache.memory_entry import MemoryTemplateCache
from backend.engine import compiled
from backend.engine.editor import MaskAwareEngine
from backend.engine.graph_book import GraphBook
from backend.engine.launches import count_launches, launched_operators
from backend.models import load_pipeline, resolve_model
from tests.factories import FAMILIES, make_engine, make_params, make_template, rect_mask

pytestmark = pytest.mark.model

# relative to the largest prediction: the compiler fuses and reorders float32 arithmetic (Flux's
# rotary runs in real arithmetic when compiled)
COMPILED_TOL = 5e-5
MASKS = (rect_mask((32, 40, 96, 80)), rect_mask((0, 0, 48, 128)))
# the same masks mirrored: other tokens, the same counts (so the same buckets) on every grid
SAME_BUCKETS = (rect_mask((32, 48, 96, 88)), rect_mask((80, 0, 128, 128)))


@pytest.fixture(scope="module", params=FAMILIES)
def engine(request, models_dir, tmp_path_factory):
    engine = make_engine(
        request.param, models_dir, tmp_path_factory.mktemp(f"cache-{request.param}")
    )
    engine.step_shapes = "bucketed"
    return engine


@pytest.fixture(scope="module")
def caches(engine):
    """Two templates' kv caches, resident on the compute device (as the device tier holds
    them)."""
    return _kv_caches(engine, torch.device("cpu"))


def _kv_caches(engine, device: torch.device | None) -> list[MemoryTemplateCache]:
    """Two templates' kv caches in host memory, or on ``device`` (the device tier's copy)."""
    params = make_params(engine, mode="kv")
    held = [
        MemoryTemplateCache.load(engine.prepare_template(make_template(seed), params).path)
        for seed in (7, 8)
    ]
    return held if device is None else [cache.to_device(device) for cache in held]


def _states(engine, caches, masks, cached: bool = True):
    params = make_params(engine, mode="kv")
    return [
        engine.start(make_template(7 + i), mask, "a cat", i, params, cache=c if cached else None)
        for i, (mask, c) in enumerate(zip(masks, caches))
    ]


def _prediction(engine, states, monkeypatch) -> torch.Tensor:
    seen = []
    with monkeypatch.context() as patch:
        patch.setattr(engine, "_advance", lambda _states, prediction: seen.append(prediction))
        engine.step(states, "kv")
    return seen[0]


def _graphs() -> int:
    from torch._dynamo.utils import counters  # dynamo loads only when a test counts graphs

    return counters["stats"]["unique_graphs"]


@pytest.mark.slow
def test_a_compiled_step_is_one_graph_equal_to_eager_replayed_for_other_masks(
    engine, caches, monkeypatch
):
    eager = _prediction(engine, _states(engine, caches, MASKS), monkeypatch)
    monkeypatch.setattr(engine, "compile_steps", "default")
    before = _graphs()
    compiled = _prediction(engine, _states(engine, caches, MASKS), monkeypatch)
    assert (compiled - eager).abs().max().item() <= COMPILED_TOL * eager.abs().max().item()
    assert _graphs() == before + 1  # the whole forward, ResNets included, in one graph
    again = _prediction(engine, _states(engine, caches, SAME_BUCKETS), monkeypatch)
    assert _graphs() == before + 1  # other masks, same shapes: no new graph
    monkeypatch.setattr(engine, "compile_steps", "off")
    assert torch.allclose(
        again,
        _prediction(engine, _states(engine, caches, SAME_BUCKETS), monkeypatch),
        atol=COMPILED_TOL * again.abs().max().item(),
    )


@pytest.mark.slow
def test_dense_and_recording_steps_run_compiled_and_equal_eager(models_dir, tmp_path, monkeypatch):
    """A step that reads no cache runs the model's own forward compiled; a recording step runs
    the mask-aware forward compiled and records the same tensors as eager."""
    engines = {}
    for mode in ("off", "default"):
        engines[mode] = make_engine("sd2-inpaint", models_dir, tmp_path / mode)
        engines[mode].step_shapes, engines[mode].compile_steps = "bucketed", mode
    params = make_params(engines["off"], mode="kv")
    dense = {
        mode: _prediction(e, [e.start(make_template(7), MASKS[0], "a cat", 0, params)], monkeypatch)
        for mode, e in engines.items()
    }
    scale = dense["off"].abs().max().item()
    assert (dense["default"] - dense["off"]).abs().max().item() <= COMPILED_TOL * scale
    before = _graphs()
    recorded = {
        mode: MemoryTemplateCache.load(e.prepare_template(make_template(8), params).path)
        for mode, e in engines.items()
    }
    assert _graphs() == before + 1  # every recording step replays one graph
    eager, compiled = recorded["off"], recorded["default"]
    for unit in range(engines["off"].num_units):
        for name in ("k", "v"):
            for step in (0, params.steps - 1):
                reference = eager.step_tensor(step, unit, name)
                difference = (compiled.step_tensor(step, unit, name) - reference).abs().max()
                assert difference.item() <= COMPILED_TOL * reference.abs().max().item()


@pytest.mark.slow
def test_a_compiled_step_reads_caches_from_host_memory_too(models_dir, tmp_path, monkeypatch):
    """Caches outside the device tier are fetched tensor by tensor, not as one step block."""
    engine = make_engine("sd2-inpaint", models_dir, tmp_path)
    engine.step_shapes = "bucketed"
    host = _kv_caches(engine, None)
    assert all(cache.device is None for cache in host)
    eager = _prediction(engine, _states(engine, host, MASKS), monkeypatch)
    monkeypatch.setattr(engine, "compile_steps", "default")
    compiled = _prediction(engine, _states(engine, host, MASKS), monkeypatch)
    assert (compiled - eager).abs().max().item() <= COMPILED_TOL * eager.abs().max().item()


def test_a_step_the_compiler_cannot_take_runs_eagerly_and_is_not_tried_again(
    engine, caches, monkeypatch
):
    eager = _prediction(engine, _states(engine, caches, MASKS), monkeypatch)
    tries = []

    def failing(mode):
        def run(*args):
            tries.append(mode)
            raise torch._dynamo.exc.Unsupported("an operator the compiler does not know")

        return run

    monkeypatch.setattr(compiled, "_compiled_forward", failing)
    monkeypatch.setattr(engine, "compile_steps", "default")
    monkeypatch.setattr(engine, "graphs", GraphBook())
    for _ in range(2):
        assert torch.equal(_prediction(engine, _states(engine, caches, MASKS), monkeypatch), eager)
    assert tries == ["default"]  # the failed shape is not compiled again
    assert engine.graphs.snapshot()["uncompilable_step_shapes"] == 1


@pytest.mark.parametrize("requests", (1, 2))
def test_a_bucketed_mask_aware_step_launches_no_more_than_the_dense_step(engine, caches, requests):
    masked = _states(engine, caches[:requests], MASKS[:requests])
    dense = _states(engine, caches[:requests], MASKS[:requests], cached=False)
    for states in (masked, dense):
        engine.step(states, "kv")  # the batch's layouts and conditioning are built once
    launched = {
        "mask-aware": count_launches(lambda: engine.step(masked, "kv")),
        "dense": count_launches(lambda: engine.step(dense, "kv")),
    }
    assert launched["mask-aware"] <= launched["dense"], launched


def test_launches_count_work_not_views():
    base = torch.randn(4, 6)
    counted = launched_operators(
        lambda: (base.t().reshape(-1).view(4, 6) + 1).to(torch.float32).contiguous()
    )
    # reshape of a transposed tensor copies, the add computes; views, a cast to the same dtype and
    # contiguous of a contiguous tensor do not count
    assert counted == {"aten::reshape": 1, "aten::add": 1}


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("mode", ("reduce-overhead", "default"))
def test_compiled_steps_on_cuda_equal_eager(models_dir, tmp_path, mode, monkeypatch):
    """On CUDA, bucketed steps replayed from CUDA graphs (``reduce-overhead``) or run as fused
    kernels equal the eager bucketed step, cached tensors read from the device tier."""
    pipe = load_pipeline("tiny-sd2-inpaint", models_dir, device="cuda")
    engine = MaskAwareEngine(
        pipe, resolve_model("tiny-sd2-inpaint"), tmp_path, step_shapes="bucketed"
    )
    caches = _kv_caches(engine, torch.device("cuda"))
    eager = _prediction(engine, _states(engine, caches, MASKS), monkeypatch)
    monkeypatch.setattr(engine, "compile_steps", mode)
    for _ in range(3):  # compiled, then replayed
        compiled = _prediction(engine, _states(engine, caches, MASKS), monkeypatch)
    assert (compiled - eager).abs().max().item() <= COMPILED_TOL * eager.abs().max().item()


@pytest.mark.slow
def test_the_graph_book_bounds_and_releases_the_compiled_steps(models_dir, tmp_path, monkeypatch):
    engine = make_engine("sd2-inpaint", models_dir, tmp_path)
    engine.step_shapes, engine.compile_steps = "bucketed", "default"
    caches = _kv_caches(engine, torch.device("cpu"))
    engine.graphs = GraphBook(max_shapes=0)  # no room: the step runs eagerly
    refused = _prediction(engine, _states(engine, caches, MASKS), monkeypatch)
    assert engine.graphs.refused > 0 and engine.graphs.shapes == {}
    engine.graphs = GraphBook()
    compiled = _prediction(engine, _states(engine, caches, MASKS), monkeypatch)
    assert engine.graphs.shapes and engine.graphs.refused == 0
    assert engine.release_graphs(1 << 20) == 0  # nothing measured on the CPU
    assert engine.graphs.shapes == {}
    again = _prediction(engine, _states(engine, caches, MASKS), monkeypatch)  # compiled anew
    scale = refused.abs().max().item()
    assert (compiled - refused).abs().max().item() <= COMPILED_TOL * scale
    assert (again - compiled).abs().max().item() <= COMPILED_TOL * scale

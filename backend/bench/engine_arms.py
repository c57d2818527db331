"""The arms of `maskserve bench engine`: each a name and how to build its runner (``ARMS``).

A runner serves one ``Batch`` (B requests of one mask ratio, stepped together) and returns the
images and the seconds of each denoising step after the first (each step waited for on CUDA).
A new arm is one entry of ``ARMS``.

* ``ordinary``: the diffusers pipeline as a user runs it, eager. It runs on its own denoiser
  modules (over the same weights), made before the engine installs its hooks, so none of
  MaskServe's code is on its path.
* ``ordinary-compiled``: the same pipeline with that denoiser under ``torch.compile`` (``mode``:
  ``max-autotune`` on CUDA, which captures CUDA graphs; inductor's default elsewhere), as a careful
  user runs it. Its forward is checked against the eager one on the inputs of a real first step
  (``CompileCheck``, within ``COMPILE_TOLERANCE`` of the output's scale).
* ``maskaware``: the mask-aware edit, eager, exact step shapes, one runner per cache mode, every
  row reading its template's cache from host RAM (pinned on CUDA), as a worker serves a hot
  template.
* ``maskaware-device``: the same edit on the same engine, every row reading its template's cache
  from the device tier (``MemoryTemplateCache.to_device``: resident on the compute device, read in
  place, one concatenation of a batch's rows per step).
* ``maskaware-compiled``: the mask-aware edit with bucketed step shapes, each step's forward
  compiled whole in the compiled arms' mode (``MaskAwareEngine(step_shapes="bucketed",
  compile_steps=compile_mode)``), the cache on the device tier. It runs on its own engine over
  its own denoiser modules (``engine_copy``), its settings and memos its own. Its first step's
  update of the latents is checked against the ``maskaware`` arm's (``check_compiled_step``,
  within ``COMPILE_TOLERANCE`` of the update's scale).
* ``ordinary-hooked``: the same pipeline call on the engine's own pipeline (its denoiser hooked,
  its projections laid out in one storage per set), as a worker's pipeline is: what the hooks cost
  the ordinary forward.
* ``ordinary-fresh-process``: the plain diffusers pipeline from the same saved model directory in
  a process that imports nothing of MaskServe (``scripts/plain_pipeline.py``), served the same
  batches in turn with the others; its call time is the one that process measures. Against it, the
  ordinary arm's ``speedup`` above 1 means the in-process ordinary arm is the slower.
"""

from __future__ import annotations

import copy
import itertools
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from backend.engine.editor import EditParams, MaskAwareEngine
from backend.engine.families import ADAPTERS
from backend.engine.ordinary import run_ordinary_batch
from backend.models.registry import quiet_libraries

PROMPT = "a red leather armchair"
ORDINARY_MODE = "dense"  # the mode recorded for arms that run the ordinary pipeline
PLAIN_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "plain_pipeline.py"
# |compiled - eager| of one denoiser forward (or one mask-aware step's update), as a share of the
# eager output's largest |value|: kernels fused in another order round differently, by about the
# dtype's precision
COMPILE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


@dataclass(frozen=True)
class Batch:
    """B requests edited together: one template, a mask, its pixels and a seed per request."""

    template: Image.Image
    masks: list[Image.Image]
    pixels: list[np.ndarray]  # bool (H, W) per mask
    seeds: list[int]


@dataclass
class ArmRun:
    images: list[Image.Image]  # one per request, before paste-back
    step_s: list[float]  # seconds between consecutive step ends
    edit_s: float | None = None  # the call's seconds as measured elsewhere (another process)


Runner = Callable[[Batch], ArmRun]


@dataclass
class BenchSetup:
    """What every arm's builder may use: the engine's pipeline (hooked), the user's pipeline (its
    own denoiser, no hooks) and the caches of each mode."""

    spec: object
    engine: MaskAwareEngine
    plain: object  # the ordinary diffusers pipeline
    ordinary_params: EditParams
    caches: dict[str, tuple[EditParams, object]]  # mode -> (params, hot cache)
    device: str
    dtype: torch.dtype
    compile_mode: str
    model_dir: Path | None  # the saved model directory; None when built in memory
    device_caches: dict[str, object] = field(default_factory=dict)  # mode -> device-tier copy

    def device_cache(self, mode: str):
        """The ``mode`` cache's copy on the compute device, made once and shared by the arms that
        read the device tier (it stays resident, in every arm's peak GPU memory from then on)."""
        if mode not in self.device_caches:
            host = self.caches[mode][1]
            self.device_caches[mode] = host.to_device(torch.device(self.device))
        return self.device_caches[mode]


@dataclass
class CompileCheck:
    """Compiled against eager on the inputs of a real first step: ``compared`` says what (one
    denoiser forward, or one mask-aware step's update of the latents)."""

    max_abs_difference: float
    reference_max_abs: float
    tolerance: float
    compared: str

    @property
    def within_tolerance(self) -> bool:
        return self.max_abs_difference <= self.tolerance


@dataclass
class BuiltArm:
    runners: dict[str, Runner]  # mode -> runner
    compiled: bool = False  # warmed up until a call compiles nothing, before any timed call
    check: CompileCheck | None = None
    extra: dict = field(default_factory=dict)  # recorded beside the arm in the JSON
    close: Callable[[], None] = lambda: None  # after the last call


def default_compile_mode(device: str) -> str:
    """``max-autotune`` (CUDA graphs, tuned kernels) on CUDA, inductor's default elsewhere."""
    return "max-autotune" if device.startswith("cuda") else "default"


def compile_denoiser(denoiser: torch.nn.Module, mode: str) -> torch.nn.Module:
    """``denoiser`` under ``torch.compile`` as a careful user compiles it: one graph (a graph
    break fails here, not silently), its shapes fixed (each batch size its own graph)."""
    return torch.compile(denoiser, mode=mode, fullgraph=True, dynamic=False)


def plain_pipeline(pipe, spec):
    """``pipe`` with its own denoiser modules over the same weights (the other parts shared): the
    pipeline a user runs, untouched by the hooks an engine installs on ``pipe`` afterwards. The
    engine re-points some of its projections at one fused storage; these keep the loaded ones,
    so only those projections are held twice."""
    name = ADAPTERS[spec.family].denoiser_name
    denoiser = getattr(pipe, name)
    weights = {id(t): t for t in itertools.chain(denoiser.parameters(), denoiser.buffers())}
    return _sharing(pipe, **{name: copy.deepcopy(denoiser, memo=weights)})


def _sharing(pipe, **parts):
    """A pipeline of ``pipe``'s class on its parts, ``parts`` replacing some, quiet as
    ``load_pipeline`` makes its pipelines."""
    restore = quiet_libraries()  # from_pipe reports the dtypes of the parts it moves
    try:
        shared = type(pipe).from_pipe(pipe, **parts)
    finally:
        restore()
    shared.set_progress_bar_config(disable=True)
    return shared


class StepClock:
    """Marks the end of each denoising step (waiting for the device on CUDA), as diffusers'
    ``callback_on_step_end`` or called directly; ``step_s`` are the gaps between marks."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.marks: list[float] = []

    def mark(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.marks.append(time.perf_counter())

    def __call__(self, pipe, step: int, timestep, tensors: dict) -> dict:
        self.mark()
        return tensors

    @property
    def step_s(self) -> list[float]:
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]


def ordinary_runner(pipe, setup: BenchSetup) -> Runner:
    def run(batch: Batch) -> ArmRun:
        clock = StepClock(setup.device)
        images = run_ordinary_batch(
            pipe,
            setup.spec,
            [batch.template] * len(batch.masks),
            batch.masks,
            [PROMPT] * len(batch.masks),
            batch.seeds,
            setup.ordinary_params,
            callback=clock,
        )
        return ArmRun(list(images), clock.step_s)

    return run


def engine_copy(plain, spec, cache_root: Path, **settings) -> MaskAwareEngine:
    """A mask-aware engine with ``settings`` (``MaskAwareEngine``'s keyword arguments) on its own
    denoiser modules over ``plain``'s weights (``plain_pipeline``): what it compiles or hooks in
    place stays its own."""
    return MaskAwareEngine(plain_pipeline(plain, spec), spec, cache_root, **settings)


def start_states(engine: MaskAwareEngine, batch: Batch, params: EditParams, cache) -> list:
    """The batch's requests admitted to ``engine``, each reading ``cache``."""
    return [
        engine.start(batch.template, mask, PROMPT, seed, params, cache=cache, pixels=pixels)
        for mask, seed, pixels in zip(batch.masks, batch.seeds, batch.pixels, strict=True)
    ]


def maskaware_runner(engine: MaskAwareEngine, device: str, params: EditParams, cache) -> Runner:
    def run(batch: Batch) -> ArmRun:
        states = start_states(engine, batch, params, cache)
        clock = StepClock(device)
        while not states[0].done:
            engine.step(states, params.mode)
            clock.mark()
        # paste-back is left to the quality measure, which applies it to every arm alike
        return ArmRun([engine.decode(state.latents, params) for state in states], clock.step_s)

    return run


def denoiser_inputs(plain, spec, params: EditParams, batch: Batch) -> tuple[tuple, dict]:
    """The arguments of ``plain``'s denoiser's first forward in an ordinary run of ``batch`` (one
    step of ``params``), cloned."""
    denoiser = getattr(plain, ADAPTERS[spec.family].denoiser_name)
    captured: list[tuple[tuple, dict]] = []

    def keep(module, args, kwargs):
        if not captured:
            captured.append(_cloned((args, kwargs)))

    handle = denoiser.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        one_step = EditParams(**{**params.to_dict(), "steps": 1})
        run_ordinary_batch(
            plain,
            spec,
            [batch.template] * len(batch.masks),
            batch.masks,
            [PROMPT] * len(batch.masks),
            batch.seeds,
            one_step,
            output_type="latent",
        )
    finally:
        handle.remove()
    return captured[0]


def _cloned(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_cloned(v) for v in value)
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    return value


def check_compiled(eager, compiled, inputs: tuple[tuple, dict], dtype: torch.dtype) -> CompileCheck:
    """``compiled`` against ``eager`` on ``inputs`` (the compiled call compiles when it must)."""
    args, kwargs = inputs
    with torch.no_grad():  # the pipelines' own grad mode: the graph the timed calls reuse
        reference = eager(*args, **kwargs)[0].float()
        difference = (compiled(*args, **kwargs)[0].float() - reference).abs().max().item()
    scale = reference.abs().max().item()
    return CompileCheck(difference, scale, COMPILE_TOLERANCE[dtype] * scale, "denoiser forward")


def first_update(engine: MaskAwareEngine, batch: Batch, params: EditParams, cache) -> torch.Tensor:
    """The change of the batch's latents over its first mask-aware step on ``engine`` (the
    scheduler's update: the guided prediction scaled by the step's size)."""
    states = start_states(engine, batch, params, cache)
    before = torch.cat([s.latents for s in states])
    engine.step(states, params.mode)  # replaces each state's latents, ``before`` stays
    return (torch.cat([s.latents for s in states]) - before).float()


def check_compiled_step(
    eager: tuple[MaskAwareEngine, object],
    compiled: tuple[MaskAwareEngine, object],
    batch: Batch,
    params: EditParams,
    dtype: torch.dtype,
) -> CompileCheck:
    """The first step's update on the ``compiled`` (engine, cache) against the ``eager`` one (the
    compiled step compiles when it must)."""
    reference = first_update(eager[0], batch, params, eager[1])
    difference = (first_update(compiled[0], batch, params, compiled[1]) - reference).abs().max()
    scale = reference.abs().max().item()
    return CompileCheck(
        difference.item(), scale, COMPILE_TOLERANCE[dtype] * scale, "first step's update"
    )


def build_ordinary(setup: BenchSetup, first: Batch) -> BuiltArm:
    return BuiltArm({ORDINARY_MODE: ordinary_runner(setup.plain, setup)})


def build_ordinary_hooked(setup: BenchSetup, first: Batch) -> BuiltArm:
    return BuiltArm({ORDINARY_MODE: ordinary_runner(setup.engine.pipe, setup)})


def build_ordinary_compiled(setup: BenchSetup, first: Batch) -> BuiltArm:
    name = ADAPTERS[setup.spec.family].denoiser_name
    eager = getattr(setup.plain, name)
    compiled = compile_denoiser(eager, setup.compile_mode)
    pipe = _sharing(setup.plain, **{name: compiled})
    inputs = denoiser_inputs(setup.plain, setup.spec, setup.ordinary_params, first)
    check = check_compiled(eager, compiled, inputs, setup.dtype)
    return BuiltArm(
        {ORDINARY_MODE: ordinary_runner(pipe, setup)},
        compiled=True,
        check=check,
        extra={"compile_mode": setup.compile_mode},
    )


def build_maskaware(setup: BenchSetup, first: Batch) -> BuiltArm:
    return BuiltArm(
        {
            mode: maskaware_runner(setup.engine, setup.device, params, cache)
            for mode, (params, cache) in setup.caches.items()
        },
        extra={"step_shapes": setup.engine.step_shapes, "cache_tier": "host"},
    )


def build_maskaware_device(setup: BenchSetup, first: Batch) -> BuiltArm:
    return BuiltArm(
        {
            mode: maskaware_runner(setup.engine, setup.device, params, setup.device_cache(mode))
            for mode, (params, _) in setup.caches.items()
        },
        extra={"step_shapes": setup.engine.step_shapes, "cache_tier": "device"},
    )


def build_maskaware_compiled(setup: BenchSetup, first: Batch) -> BuiltArm:
    engine = engine_copy(
        setup.plain,
        setup.spec,
        setup.engine.cache_root,
        step_shapes="bucketed",
        compile_steps=setup.compile_mode,
    )
    runners, checks = {}, []
    for mode, (params, host) in setup.caches.items():
        cache = setup.device_cache(mode)
        checks.append(
            check_compiled_step((setup.engine, host), (engine, cache), first, params, setup.dtype)
        )
        runners[mode] = maskaware_runner(engine, setup.device, params, cache)
    return BuiltArm(
        runners,
        compiled=True,
        # the cache mode whose step came closest to (or went furthest over) its bound
        check=max(checks, key=lambda c: c.max_abs_difference / c.tolerance),
        extra={
            "step_shapes": "bucketed",
            "compile_steps": setup.compile_mode,
            "cache_tier": "device",
        },
    )


def build_fresh_process(setup: BenchSetup, first: Batch) -> BuiltArm:
    if setup.model_dir is None:
        raise ValueError("the fresh-process arm loads a saved model directory: not --in-memory")
    spec, params = setup.spec, setup.ordinary_params
    argv = [
        sys.executable,
        str(PLAIN_SCRIPT),
        *("--model-dir", str(setup.model_dir), "--prompt", PROMPT, "--size", str(params.size[0])),
        *("--steps", str(params.steps), "--guidance", str(params.guidance)),
        *("--device", setup.device, "--dtype", str(setup.dtype).removeprefix("torch.")),
    ]
    if spec.uses_cfg:
        argv.append("--negative-prompts")
    if spec.max_sequence_length:
        argv += ["--max-sequence-length", str(spec.max_sequence_length)]
    if spec.form == "checkpoint" and spec.uses_cfg:
        argv.append("--euler")  # as load_pipeline gives checkpoints
    scratch = tempfile.TemporaryDirectory(prefix="plain-pipeline-")
    folder = Path(scratch.name)
    log = (folder / "stderr.log").open("w")  # its loading chatter; the error if it fails
    child = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
    )

    def reply() -> dict:
        line = child.stdout.readline()
        if not line:
            tail = (folder / "stderr.log").read_text()[-2000:]
            raise RuntimeError(f"{PLAIN_SCRIPT.name} ended (exit {child.wait()}):\n{tail}")
        return json.loads(line)

    def run(batch: Batch) -> ArmRun:
        batch.template.save(folder / "template.png")
        for row, mask in enumerate(batch.masks):
            mask.save(folder / f"mask{row}.png")
        rows = range(len(batch.masks))
        request = {
            "template": str(folder / "template.png"),
            "masks": [str(folder / f"mask{row}.png") for row in rows],
            "seeds": batch.seeds,
            "outputs": [str(folder / f"out{row}.png") for row in rows],
        }
        child.stdin.write(json.dumps(request) + "\n")
        child.stdin.flush()
        answer = reply()
        images = [Image.open(path).convert("RGB") for path in request["outputs"]]
        return ArmRun(images, answer["step_s"], answer["edit_s"])

    def close() -> None:
        child.stdin.close()
        child.wait()
        log.close()
        scratch.cleanup()

    ready = reply()
    ready.pop("ready")
    return BuiltArm({ORDINARY_MODE: run}, extra=ready, close=close)


# name -> builder(setup, first batch) of its runners; the order is the order arms take turns
ARMS: dict[str, Callable[[BenchSetup, Batch], BuiltArm]] = {
    "ordinary": build_ordinary,
    "ordinary-compiled": build_ordinary_compiled,
    "maskaware": build_maskaware,
    "maskaware-device": build_maskaware_device,
    "maskaware-compiled": build_maskaware_compiled,
    "ordinary-hooked": build_ordinary_hooked,
    "ordinary-fresh-process": build_fresh_process,
}
FRESH_PROCESS_ARM = "ordinary-fresh-process"
# arms that read the template caches
MASKAWARE_ARMS = frozenset({"maskaware", "maskaware-device", "maskaware-compiled"})


def arm_names(text: str) -> list[str]:
    """``--arms``: names of ``ARMS`` separated by commas; ValueError naming the flag otherwise."""
    names = [part for part in text.split(",") if part]
    unknown = [name for name in names if name not in ARMS]
    if not names or unknown:
        raise ValueError(
            f"--arms: {', '.join(unknown) or repr(text)} is not an arm; the arms are "
            f"{', '.join(ARMS)}"
        )
    return names

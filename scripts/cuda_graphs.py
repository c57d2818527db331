"""How much of a UNet's denoising step on a GPU is the host launching kernels: the ordinary
(dense) UNet forward run eagerly, against the same forward replayed from a captured CUDA graph.

On the H200 the mask-aware edit was slower than the ordinary pipeline because both steps are
bound by launching operators, not by the compute the cache skips (docs/bench/gpu-h200.md). A
graph replays a whole forward with one launch; the ratio of the two times is how much a graphed
step could gain, and the graphed time is the step's compute, against which the mask-aware step's
FLOP ideal can be held. Inputs are random (a forward's time does not depend on its values); each
batch size counts the UNet's rows (classifier-free guidance doubles a request's).

    PYTHONPATH=. python3 scripts/cuda_graphs.py --model arch-sd2-inpaint --size 512 \\
        --rows 2,16 --json graphs.json

Without CUDA (``--device cpu``) only the eager forward is timed (the graph fields are null), which
is how the tests run it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from backend.bench.commands import request_counts
from backend.engine.factory import DTYPES
from backend.models import load_pipeline, resolve_model


def unet_inputs(unet, rows: int, size: int, device: str, dtype: torch.dtype) -> dict:
    """Random inputs of one UNet forward of ``rows`` rows at ``size`` px (latents at 1/8), with
    SDXL's added conditions when the UNet takes them."""
    config, side = unet.config, size // 8
    inputs = {
        "sample": torch.randn(rows, config.in_channels, side, side, device=device, dtype=dtype),
        "timestep": torch.full((rows,), 500.0, device=device),
        "encoder_hidden_states": torch.randn(
            rows, 77, config.cross_attention_dim, device=device, dtype=dtype
        ),
    }
    if config.addition_embed_type == "text_time":
        time_dim = config.addition_time_embed_dim
        pooled = config.projection_class_embeddings_input_dim - 6 * time_dim
        inputs["added_cond_kwargs"] = {
            "text_embeds": torch.randn(rows, pooled, device=device, dtype=dtype),
            "time_ids": torch.randn(rows, 6, device=device, dtype=dtype),
        }
    return inputs


def median_ms(run: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    """Median wall time of ``run`` over ``repeats`` calls, each waited for (``sync``), in ms."""
    times = []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        run()
        sync()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def graphed(forward: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``forward`` captured in a CUDA graph after warm-up runs on a side stream (as capture
    requires); its output tensor is the graph's, rewritten by every replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = forward()
    return graph, output


def probe(unet, rows: int, size: int, device: str, dtype: torch.dtype, repeats: int) -> dict:
    """One batch size: eager and (on CUDA) graphed forward times, and how far the replay's output
    is from the eager one on the same inputs."""
    inputs = unet_inputs(unet, rows, size, device, dtype)

    def forward() -> torch.Tensor:
        return unet(**inputs, return_dict=False)[0]

    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with torch.inference_mode():
        eager_out = forward()
        eager_ms = median_ms(forward, repeats, sync)
        record = {"rows": rows, "eager_ms": eager_ms, "graph_ms": None, "speedup": None}
        if cuda:
            graph, graph_out = graphed(forward)
            graph_ms = median_ms(graph.replay, repeats, sync)
            difference = (graph_out.float() - eager_out.float()).abs().max().item()
            record |= {
                "graph_ms": graph_ms,
                "speedup": eager_ms / graph_ms,
                "max_abs_difference": difference,
            }
    return record


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="arch-sd2-inpaint")
    parser.add_argument("--size", type=int, default=512, help="px (latents at 1/8)")
    parser.add_argument("--rows", default="2,4,8,16", help="UNet rows per forward")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--models-dir", default=".maskserve/models")
    parser.add_argument("--json", default="")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if resolve_model(args.model).family not in ("sd2-inpaint", "sdxl-inpaint"):
        parser.error(f"{args.model}: UNet models only (sd2-inpaint, sdxl-inpaint)")
    try:
        rows = request_counts(args.rows, "--rows")
    except ValueError as exc:
        parser.error(str(exc))
    dtype = DTYPES[args.dtype]
    pipe = load_pipeline(args.model, Path(args.models_dir), args.device, dtype, {"unet"})
    records = []
    for count in rows:
        record = probe(pipe.unet, count, args.size, args.device, dtype, args.repeats)
        records.append(record)
        print(json.dumps(record))
    report = {
        "model": args.model,
        "size": args.size,
        "dtype": args.dtype,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "records": records,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

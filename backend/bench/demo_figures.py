"""Figures of ``maskserve bench demo``: fidelity against mask ratio, and the before/after grid."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

CAPTION_PX = 14
MASK_TINT = (255, 0, 255)


def plot_fidelity(summary: dict, records: list[dict], path: Path) -> None:
    """SSIM inside the mask (mask-aware vs ordinary) per mask ratio, and colour agreement per
    arm (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for mode, by_ratio in summary["fidelity"].items():
        ratios = [float(r) for r in by_ratio]
        left.plot(ratios, [v["ssim_masked_mean"] for v in by_ratio.values()], "o-", label=mode)
        left.plot(
            ratios, [v["ssim_masked_min"] for v in by_ratio.values()], "x:", label=f"{mode} min"
        )
    left.set_xlabel("mask ratio")
    left.set_ylabel("SSIM inside the mask vs ordinary")
    left.set_ylim(0, 1.02)
    left.legend()
    sources = [s for s in ("painted", "sweep") if s in summary]
    arms = tuple(summary[sources[0]]) if sources else ()
    width = 0.8 / len(sources)
    for offset, source in enumerate(sources):
        values = [summary[source][arm]["colour_agreement"] * 100 for arm in arms]
        right.bar(np.arange(len(arms)) + offset * width, values, width, label=f"{source} masks")
    right.axhline(80, color="grey", linestyle="--", linewidth=1)
    right.set_xticks(np.arange(len(arms)) + width * (len(sources) - 1) / 2, arms)
    right.set_ylabel("colour agreement (%)")
    right.set_ylim(0, 100)
    right.legend()
    model = records[0]["model"] if records else ""
    fig.suptitle(f"{model}: held-out scenes, prompted colour and shape", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _outlined(template: Image.Image, mask: np.ndarray) -> Image.Image:
    """The template with the mask's border drawn in magenta (what the user painted)."""
    pixels = np.asarray(template.convert("RGB")).copy()
    inner = np.zeros_like(mask)
    inner[1:-1, 1:-1] = mask[1:-1, 1:-1] & mask[:-2, 1:-1] & mask[2:, 1:-1]
    inner[1:-1, 1:-1] &= mask[1:-1, :-2] & mask[1:-1, 2:]
    pixels[mask & ~inner] = MASK_TINT
    return Image.fromarray(pixels)


def save_grid(grid: dict, records: list[dict], path: Path, mode: str = "kv") -> None:
    """4 x 4 pairs (template with its mask outlined, then the mask-aware edit), each captioned
    with its prompt and whether its colour agrees."""
    items = sorted(grid.items())
    if not items:
        return
    side = items[0][1]["template"].width
    columns = 4
    rows = (len(items) + columns - 1) // columns
    canvas = Image.new("RGB", (columns * 2 * side, rows * (side + CAPTION_PX)), "white")
    draw = ImageDraw.Draw(canvas)
    for slot, (index, images) in enumerate(items):
        x = (slot % columns) * 2 * side
        y = (slot // columns) * (side + CAPTION_PX)
        canvas.paste(_outlined(images["template"], images["mask"]), (x, y))
        canvas.paste(images[mode], (x + side, y))
        record = records[index]
        mark = "ok" if record[mode]["agrees"] else "no"
        draw.text((x + 2, y + side + 1), f"{record['prompt']} [{mark}]", fill="black")
    canvas.save(path)

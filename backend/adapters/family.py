"""Which model family a LoRA file was trained for, told from its tensor names alone (no tensor is
read, no model library imported), so an adapter of another family is refused saying so instead of
failing later on keys or shapes diffusers cannot map.

The names tell the denoiser's architecture in every layout the reader takes (diffusers/PEFT, the
older diffusers ``.lora.down`` names, kohya's ``lora_unet_..._``, the SGM ``input_blocks`` names
of kohya's SDXL files): ``_`` and ``.`` are read alike.

* Flux: its transformer's own blocks and embedders (``single_transformer_blocks``,
  ``double_blocks``, ``x_embedder``, ``ff_context``, a block's joint ``attn``, where a UNet's
  blocks have ``attn1`` and ``attn2``, ...);
* a Stable Diffusion UNet: ``down_blocks`` / ``up_blocks`` / ``mid_block`` (``input_blocks`` /
  ``output_blocks`` / ``middle_block``), and which one by where its attention starts: SD 1.x/2.x
  attend at the first level down (``down_blocks.0.attentions``, ``input_blocks.1.1``), SDXL does
  not and attends at the first level up (``up_blocks.0.attentions``, ``output_blocks.0.1``).

Rule: a family is named only when the names say it; a UNet whose attention layers the adapter does
not touch is ``UNET`` (SD2 or SDXL: the shape check against the model tells them apart), and a
file with none of these names is ``None`` (its other checks say what is wrong).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

UNET = "unet"  # a Stable Diffusion UNet, SD 1.x/2.x or SDXL: not told apart by the names
UNET_FAMILIES = ("sd2-inpaint", "sdxl-inpaint")
LABELS = {
    "sd2-inpaint": "SD 1.x/2.x (sd2-inpaint)",
    "sdxl-inpaint": "SDXL (sdxl-inpaint)",
    "flux-fill": "Flux (flux-fill)",
    UNET: "a Stable Diffusion UNet (sd2-inpaint or sdxl-inpaint)",
}
# on a name with every "_" read as "." and a "." at each end
_FLUX = re.compile(
    r"\.(single\.transformer\.blocks|double\.blocks|single\.blocks|x\.embedder"
    r"|context\.embedder|ff\.context|add\.[qkv]\.proj|transformer\.blocks\.\d+\.attn)\."
)
_UNET = re.compile(
    r"\.(down\.blocks|up\.blocks|mid\.block|input\.blocks|output\.blocks|middle\.block)\."
)
_SD2 = re.compile(r"\.(down\.blocks\.0\.attentions|input\.blocks\.[12]\.1)\.")
_SDXL = re.compile(r"\.(up\.blocks\.0\.attentions|output\.blocks\.[012]\.1)\.")


def adapter_family(keys: Iterable[str]) -> str | None:
    """The family ``keys`` (a safetensors file's tensor names) were trained for: one of
    ``LABELS`` (``UNET`` when only the architecture is told), or None when the names do not say."""
    names = [f".{key.lower().replace('_', '.')}." for key in keys]
    if any(_FLUX.search(name) for name in names):
        return "flux-fill"
    if not any(_UNET.search(name) for name in names):
        return None
    sd2, sdxl = (any(pattern.search(name) for name in names) for pattern in (_SD2, _SDXL))
    if sd2 != sdxl:
        return "sd2-inpaint" if sd2 else "sdxl-inpaint"
    return UNET


def other_family(keys: Iterable[str], family: str) -> str | None:
    """What is wrong when ``keys`` name another family than the model's ``family``: a message
    naming both; None when they are the same or cannot be told apart."""
    found = adapter_family(keys)
    if found is None or found == family or (found == UNET and family in UNET_FAMILIES):
        return None
    return (
        f"this adapter is for {LABELS[found]}, the model is {LABELS.get(family, family)}: "
        f"upload an adapter trained for {family}, or register this one for a model of its family"
    )

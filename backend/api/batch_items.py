"""How a batch's masks and prompts pair into items: pure, shared by the REST route and the CLI.

Rules (what batch-inpainting tools do with a mask folder and a prompt list):

* masks only: one item per mask, each with the shared prompt;
* prompts only: one item per prompt, each with the one shared mask;
* one mask and several prompts: one item per prompt, all with that mask;
* several masks and one prompt: one item per mask, all with that prompt;
* as many masks as prompts: mask i with prompt i;
* any other counts are refused, saying both counts and the ways to fix it.
"""

from __future__ import annotations


class PairingError(ValueError):
    """The masks and prompts cannot be paired: the message says the counts and what to do."""


def pair_items(masks: int, prompts: int, shared_mask: bool) -> list[tuple[int | None, int | None]]:
    """(mask index, prompt index) of each item, in item order; ``None``: the shared mask (or
    prompt). ``shared_mask``: the request gives one mask for all items besides its list."""
    if masks < 0 or prompts < 0:
        raise PairingError("mask and prompt counts cannot be negative")
    if masks == 0 and prompts == 0:
        raise PairingError("a batch needs masks (several mask files) and/or prompts (a list)")
    if masks == 0:
        if not shared_mask:
            raise PairingError(
                f"{prompts} prompt(s) but no mask: give one mask for them all, or one per prompt"
            )
        return [(None, i) for i in range(prompts)]
    if prompts == 0:
        return [(i, None) for i in range(masks)]
    if masks == prompts:
        return [(i, i) for i in range(masks)]
    if masks == 1:
        return [(0, i) for i in range(prompts)]
    if prompts == 1:
        return [(i, 0) for i in range(masks)]
    raise PairingError(
        f"{masks} masks and {prompts} prompts cannot be paired: give as many prompts as masks "
        "(mask i gets prompt i), one prompt for every mask, or one mask for every prompt"
    )

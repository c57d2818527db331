"""The cache tiers' automatic budgets, chosen once at start-up from what the shell measured (free
disk space, free device memory). Pure: the measurements come in as arguments."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from backend.costmodel.costs import UnitShape


@dataclass(frozen=True)
class TierBudget:
    """A tier's budget and why (logged at start-up)."""

    budget_bytes: int
    reason: str


def choose_disk_budget(
    configured_bytes: int | None, free_share: float, free_bytes: int, held_bytes: int
) -> TierBudget:
    """The disk tier's budget: ``configured_bytes`` when set (an explicit budget wins, even above
    what the file system has: the reason says so), else ``free_share`` of the room the cache can
    have, the free space plus what its entries already hold (``held_bytes``). The automatic budget
    never exceeds that room, so recordings are skipped before the file system fills."""
    if not 0.0 < free_share <= 1.0:
        raise ValueError(f"disk_free_share must be in (0, 1], got {free_share}")
    if configured_bytes is not None and configured_bytes < 0:
        raise ValueError("the disk budget must be >= 0 bytes")
    room = max(free_bytes, 0) + max(held_bytes, 0)
    if configured_bytes is not None:
        note = (
            f"; above the {room} bytes free or held by the cache: a write that finds the disk full "
            "makes its row compute without the cache"
            if configured_bytes > room
            else ""
        )
        return TierBudget(configured_bytes, f"configured {configured_bytes} bytes{note}")
    budget = int(free_share * room)
    return TierBudget(
        budget,
        f"auto: {free_share:g} of {room} bytes ({free_bytes} free + {held_bytes} held by entries)",
    )


def choose_device_budget(
    configured_bytes: int | None,
    free_bytes: int | None,
    total_bytes: int,
    batch_bytes: int,
    margin_share: float,
) -> TierBudget:
    """The device tier's budget: ``configured_bytes`` when set (0 turns the tier off), else what
    the device has free once the model is loaded (``free_bytes``, None on a device that does not
    say: then the tier is off) less a full batch's activations (``batch_bytes``) and a margin of
    ``margin_share`` of the device's ``total_bytes``; never below 0."""
    if not 0.0 <= margin_share < 1.0:
        raise ValueError(f"device_margin_share must be in [0, 1), got {margin_share}")
    if configured_bytes is not None:
        if configured_bytes < 0:
            raise ValueError("the device budget must be >= 0 bytes")
        return TierBudget(configured_bytes, f"configured {configured_bytes} bytes")
    if free_bytes is None:
        return TierBudget(0, "off: the device reports no free memory (set it to turn it on)")
    margin = int(margin_share * total_bytes)
    budget = max(0, free_bytes - batch_bytes - margin)
    return TierBudget(
        budget,
        f"auto: {free_bytes} bytes free after the model, less {batch_bytes} for a full batch's "
        f"activations and a margin of {margin_share:g} of {total_bytes} bytes",
    )


def batch_activation_bytes(
    units: Sequence[UnitShape], requests: int, rows_per_request: int, element_bytes: int
) -> int:
    """An estimate of a full batch's activations on the device, from the model's unit shapes:
    every row through the widest unit, its image and text tokens each holding the unit's input,
    Q, K, V, attention output and MLP hidden activations (``4 + ffn_mult`` times its width), plus
    one step of every request's template cache copied in from host memory."""
    widest = max(
        ((u.num_tokens + u.num_text_tokens) * u.hidden_dim * (4 + u.ffn_mult) for u in units),
        default=0.0,
    )
    step_cache = sum(u.cache_bytes for u in units)
    return int(requests * rows_per_request * widest * element_bytes) + requests * step_cache

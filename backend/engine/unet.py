"""Mask-aware execution of the transformer stacks of a diffusers UNet (SD2, SDXL inpainting).

ResNets and convolutions stay dense. Each ``Transformer2DModel`` of the UNet is a *stack*; each of
its ``BasicTransformerBlock`` is a *unit* (numbered in execution order over the whole UNet). A unit
that uses the cache runs self-attention queries, cross-attention, output projections and the
feed-forward on the masked tokens only:

* ``kv`` mode: masked queries attend over [fresh masked K/V ; cached unmasked K/V]; only masked
  hidden rows flow to the next unit, so a dense unit can never follow a cached one in a stack.
* ``hidden`` mode: K/V are projected from the full input (unmasked rows come from the cached
  output of the previous unit), the unit's unmasked output rows come from its own cache.

When the last unit of a stack uses the cache, the unmasked rows of the stack's ``proj_out`` output
(``delta``, before the residual) come from the cache too. A unit that does not use the cache runs
densely on all tokens. With no active ``ForwardContext`` the ordinary diffusers forward runs.

Strict: install checks every block, attention and processor the forward reimplements and refuses
other models at load; each forward refuses arguments it does not implement (attention masks,
cross-attention kwargs) with an error naming them. Self-attention q/k/v and cross-attention k/v
projections share one weight storage per set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers.hooks import HookRegistry
from diffusers.models.attention import BasicTransformerBlock
from diffusers.models.attention_processor import Attention, AttnProcessor2_0
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.transformers.transformer_2d import Transformer2DModel

from backend.engine.attention import fuse_linears, ragged_attention
from backend.engine.context import ForwardContext, UnitIO
from backend.engine.layout import RowLayout
from backend.engine.lora import feed_forward, linear, project
from backend.engine.strict import (
    RUN_ORDINARY,
    StrictForwardHook,
    UnsupportedForwardError,
    require,
    require_type,
)

HOOK_NAME = "maskserve_unet_stack"
_MASKS = "attention masks are not applied (masked tokens attend over every key); " + RUN_ORDINARY


@dataclass(frozen=True)
class UnetStackInfo:
    stack_id: int
    first_unit: int
    num_units: int


def unet_stacks(unet: torch.nn.Module) -> list[Transformer2DModel]:
    """Transformer2DModel modules of a UNet in execution order (down, mid, up)."""
    parts = (
        list(unet.down_blocks)
        + ([unet.mid_block] if unet.mid_block is not None else [])
        + list(unet.up_blocks)
    )
    return [attn for part in parts for attn in getattr(part, "attentions", [])]


class _MaskAwareStackHook(StrictForwardHook):
    # timestep, class_labels and added_cond_kwargs feed only ada-norm blocks; the structure check
    # admits layer-norm blocks alone, whose stock forward ignores them too.
    implemented = frozenset(
        {
            "hidden_states",
            "encoder_hidden_states",
            "timestep",
            "class_labels",
            "added_cond_kwargs",
            "return_dict",
        }
    )
    advice = {
        "cross_attention_kwargs": "cross-attention kwargs (a LoRA scale, GLIGEN inputs) are not "
        "applied; merge LoRA weights into the model (pipe.fuse_lora()) or " + RUN_ORDINARY,
        "attention_mask": _MASKS,
        "encoder_attention_mask": _MASKS,
    }

    def __init__(self, info: UnetStackInfo):
        super().__init__()
        self.info = info

    def run(self, module: Transformer2DModel, ctx: ForwardContext, arguments: dict[str, Any]):
        _check_processors(module)
        text = arguments["encoder_hidden_states"]
        if text is None and any(b.attn2 is not None for b in module.transformer_blocks):
            raise UnsupportedForwardError(
                "the mask-aware UNet stack needs encoder_hidden_states for its cross-attention "
                "(the stock forward would let the image attend to itself): pass the text embedding"
            )
        sample = run_stack(module, self.info, arguments["hidden_states"], text, ctx)
        if arguments["return_dict"]:
            return Transformer2DModelOutput(sample=sample)
        return (sample,)


def install_unet_hooks(unet: torch.nn.Module) -> list[UnetStackInfo]:
    """Check every transformer stack of ``unet`` (else ``UnsupportedModelError``), lay each set of
    projections reading one input out in one weight storage (``fuse_linears``: no copy is kept)
    and patch the stacks (idempotent); return the stacks in execution order."""
    infos, first_unit = [], 0
    for stack_id, stack in enumerate(unet_stacks(unet)):
        _check_stack(stack, f"transformer stack {stack_id}")
        for block in stack.transformer_blocks:
            fuse_linears((block.attn1.to_q, block.attn1.to_k, block.attn1.to_v))
            if block.attn2 is not None:
                fuse_linears((block.attn2.to_k, block.attn2.to_v))
        info = UnetStackInfo(stack_id, first_unit, len(stack.transformer_blocks))
        registry = HookRegistry.check_if_exists_or_initialize(stack)
        if registry.get_hook(HOOK_NAME) is None:
            registry.register_hook(_MaskAwareStackHook(info), HOOK_NAME)
        infos.append(info)
        first_unit += info.num_units
    return infos


def _check_stack(stack: Transformer2DModel, where: str) -> None:
    require(
        stack.is_input_continuous and stack.use_linear_projection,
        where,
        "continuous inputs with linear projections",
    )
    for index, block in enumerate(stack.transformer_blocks):
        at = f"{where} block {index}"
        require_type(block, (BasicTransformerBlock,), at)
        require(
            block.norm_type == "layer_norm"
            and not block.only_cross_attention
            and block.pos_embed is None
            and getattr(block, "fuser", None) is None,
            at,
            "plain layer norms, self-attention, no positional embedding and no GLIGEN fuser",
        )
        for name in ("attn1", "attn2"):
            attn = getattr(block, name)
            if attn is not None:
                _check_attention(attn, f"{at}.{name}", cross=name == "attn2")
    _check_processors(stack)


def _check_attention(attn, where: str, cross: bool) -> None:
    require_type(attn, (Attention,), where)
    require(
        attn.group_norm is None
        and attn.spatial_norm is None
        and attn.norm_q is None
        and attn.norm_cross is None
        and not attn.residual_connection
        and attn.rescale_output_factor == 1.0
        and attn.is_cross_attention == cross,
        where,
        "no group, spatial, q/k or cross norm, no residual or output rescale"
        + (" and a text input" if cross else " and no text input"),
    )


def _check_processors(stack: Transformer2DModel) -> None:
    """Also run on every mask-aware forward: processors can be swapped after install (IP-Adapter
    loading, ``set_attn_processor``) and the mask-aware forward would not run theirs."""
    for index, block in enumerate(stack.transformer_blocks):
        for attn in (block.attn1, block.attn2):
            if attn is not None:
                require_type(attn.processor, (AttnProcessor2_0,), f"block {index}'s processor")


class _State:
    """Hidden rows flowing between units: ``full`` (rows, L, C) when every row is valid, else only
    ``packed`` masked rows (kv mode after a cached unit)."""

    def __init__(self, full: torch.Tensor | None, packed: torch.Tensor | None):
        self.full, self.packed = full, packed


def run_stack(
    stack: Transformer2DModel,
    info: UnetStackInfo,
    x: torch.Tensor,
    text: torch.Tensor,
    ctx: ForwardContext,
) -> torch.Tensor:
    num_rows, channels, height, width = x.shape
    ctx.require_rows(num_rows)
    residual = x
    # (rows, tokens, C) as a view of the channels-first norm: the masked tokens are gathered
    # straight from it (one operator), never copied into a tokens-first tensor first
    normed = stack.norm(x).permute(0, 2, 3, 1).flatten(1, 2)
    masked = ctx.layout((height, width))
    units = range(info.first_unit, info.first_unit + info.num_units)
    first_cached_kv = ctx.uses_cache(info.first_unit) and ctx.mode == "kv"
    if first_cached_kv:
        state = _State(None, linear(ctx.lora, stack.proj_in, masked.gather(normed), masked))
    else:
        state = _State(linear(ctx.lora, stack.proj_in, normed, None), None)
    for unit, block in zip(units, stack.transformer_blocks):
        with ctx.timed_unit(unit):
            state = _run_unit(block, unit, state, text, masked, ctx)
    last = info.first_unit + info.num_units - 1
    if ctx.uses_cache(last):
        packed = state.packed if state.packed is not None else masked.gather(state.full)
        fresh = linear(ctx.lora, stack.proj_out, packed, masked)
        ctx.cache.wait_for(last)
        delta = ctx.merge_cached(last, "delta", masked, fresh)
    else:
        delta = linear(ctx.lora, stack.proj_out, state.full, None)
        ctx.record(last, "delta", delta)
    # the residual first: the sum takes its (channels-first, contiguous) layout, so the permuted
    # delta needs no copy of its own
    return residual + delta.reshape(num_rows, height, width, -1).permute(0, 3, 1, 2)


def _run_unit(
    block, unit: int, state: _State, text: torch.Tensor, masked: RowLayout, ctx: ForwardContext
) -> _State:
    if not ctx.uses_cache(unit):
        if state.full is None:
            raise RuntimeError(f"unit {unit}: a dense unit cannot follow a cached unit in kv mode")
        dense = ctx.dense_layout(state.full.shape[1])
        keys = _text_keys(block.attn2, text, ctx.lora)
        x_flat = state.full.reshape(-1, state.full.shape[-1])
        out = _block_forward(block, x_flat, dense, state.full, keys, UnitIO(ctx, unit))
        out_full = out.reshape(state.full.shape)
        ctx.record(unit, "out", out_full)
        return _State(out_full, None)
    ctx.cache.wait_for(unit)
    keys = _text_keys(block.attn2, text, ctx.lora)
    if ctx.mode == "kv":
        packed = state.packed if state.packed is not None else masked.gather(state.full)
        return _State(None, _block_forward(block, packed, masked, None, keys, UnitIO(ctx, unit)))
    packed = _block_forward(
        block, masked.gather(state.full), masked, state.full, keys, UnitIO(ctx, unit)
    )
    return _State(ctx.merge_cached(unit, "out", masked, packed), None)


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(..., H*d) -> (..., H, d)."""
    return x.unflatten(-1, (heads, -1))


def _text_keys(attn2, text: torch.Tensor, lora) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Cross-attention K and V (rows, T, H, d) of the text (None without cross-attention). They
    depend on the text and the weights alone, so a batch's text tensor (kept while its rows step
    together: ``FamilyAdapter.batch_conditioning``) keeps them per layer, unless an adapter
    changes them."""
    if attn2 is None:
        return None
    if lora is not None and lora.touches(attn2.to_k, attn2.to_v):
        return tuple(
            _heads(p, attn2.heads) for p in project(lora, text, (attn2.to_k, attn2.to_v), None)
        )
    if torch.compiler.is_compiling():  # a compiled step computes them in its graph
        return tuple(
            _heads(p, attn2.heads) for p in project(None, text, (attn2.to_k, attn2.to_v), None)
        )
    kept = text.__dict__.setdefault("_maskserve_text_keys", {})
    if id(attn2) not in kept:
        kept[id(attn2)] = tuple(
            _heads(p, attn2.heads) for p in project(None, text, (attn2.to_k, attn2.to_v), None)
        )
    return kept[id(attn2)]


def _block_forward(
    block,
    x_q: torch.Tensor,
    layout_q: RowLayout,
    x_full: torch.Tensor | None,
    text_keys: tuple[torch.Tensor, torch.Tensor] | None,
    io: UnitIO,
) -> torch.Tensor:
    """One BasicTransformerBlock on packed query tokens ``x_q`` (total, C), with the text's
    cross-attention K and V (``_text_keys``).

    K/V of self-attention come from ``x_full`` (rows, L, C) when given (dense or hidden mode), else
    from the unit's cache (``io.merge``) with the tokens of ``layout_q`` replaced by fresh K/V.
    """
    attn1, attn2 = block.attn1, block.attn2
    heads, lora = attn1.heads, io.lora
    normed_q = block.norm1(x_q)
    if x_full is None or layout_q.is_full:
        query, key_q, value_q = project(
            lora, normed_q, (attn1.to_q, attn1.to_k, attn1.to_v), layout_q
        )
    else:
        query = linear(lora, attn1.to_q, normed_q, layout_q)
    query = _heads(query, heads)
    if x_full is not None:
        if layout_q.is_full:
            key_full, value_full = (
                key_q.reshape(x_full.shape[:2] + (-1,)),
                value_q.reshape(x_full.shape[:2] + (-1,)),
            )
        else:
            key_full, value_full = project(
                lora, block.norm1(x_full), (attn1.to_k, attn1.to_v), None
            )
        io.record("k", key_full)
        io.record("v", value_full)

        def kv_for_group(group):
            return _heads(key_full[group[0] : group[1]], heads), _heads(
                value_full[group[0] : group[1]], heads
            )
    else:
        key_rows = _heads(io.merge("k", layout_q, key_q), heads)
        value_rows = _heads(io.merge("v", layout_q, value_q), heads)

        def kv_for_group(group):
            return key_rows[group[0] : group[1]], value_rows[group[0] : group[1]]

    padded = io.padded
    attn_out = ragged_attention(query, layout_q, kv_for_group, padded).flatten(1)
    hidden = linear(lora, attn1.to_out[0], attn_out, layout_q) + x_q
    if attn2 is not None and text_keys is not None:
        query2 = _heads(linear(lora, attn2.to_q, block.norm2(hidden), layout_q), attn2.heads)
        key2, value2 = text_keys
        cross = ragged_attention(
            query2, layout_q, lambda g: (key2[g[0] : g[1]], value2[g[0] : g[1]]), padded
        )
        hidden = linear(lora, attn2.to_out[0], cross.flatten(1), layout_q) + hidden
    return feed_forward(lora, block.ff, block.norm3(hidden), layout_q) + hidden

"""Mask-aware execution of a diffusers ``FluxTransformer2DModel`` (Flux Fill).

Units are the double-stream blocks then the single-stream blocks (one stack). Image tokens of
every row are gathered right after the patch embedding into one packed sequence; every linear,
norm, modulation and MLP then runs on masked tokens only. Text tokens are always computed.
Attention: masked image queries and all text queries attend over [text K/V ; image K/V], where the
image K/V of unmasked tokens come from the cache (``kv`` mode, K cached after its RMS norm and
rotary embedding) or are projected from the full hidden input (``hidden`` mode, whose unmasked
output rows come from the cache). The model output is scattered back to the full token grid;
rows of unmasked tokens are zero (the engine takes them from the template trajectory).

Strict: install checks every part the forward reimplements (block, norm, attention and processor
classes) and refuses other models at load; each forward refuses arguments it does not implement
(ControlNet residuals, joint-attention kwargs, ids off the row-major grid) with an error naming
them. q/k/v (and single blocks' MLP input) projections share one weight storage per set.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.hooks import HookRegistry
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.normalization import (
    AdaLayerNormContinuous,
    AdaLayerNormZero,
    AdaLayerNormZeroSingle,
)
from diffusers.models.transformers.transformer_flux import (
    FluxAttention,
    FluxAttnProcessor,
    FluxPosEmbed,
    FluxSingleTransformerBlock,
    FluxTransformerBlock,
)

from backend.engine.attention import attend, fuse_linears, pad_rows, unpad_rows
from backend.engine.context import ForwardContext, UnitIO, cat_once
from backend.engine.layout import RowLayout
from backend.engine.lora import feed_forward, linear, project
from backend.engine.strict import (
    RUN_ORDINARY,
    StrictForwardHook,
    UnsupportedForwardError,
    require,
    require_type,
)

HOOK_NAME = "maskserve_flux"
_CONTROLNET = "ControlNet residuals are not added by the mask-aware forward; " + RUN_ORDINARY


@dataclass(frozen=True)
class FluxInfo:
    num_double: int
    num_single: int

    @property
    def num_units(self) -> int:
        return self.num_double + self.num_single


class _MaskAwareFluxHook(StrictForwardHook):
    implemented = frozenset(
        {
            "hidden_states",
            "encoder_hidden_states",
            "pooled_projections",
            "timestep",
            "img_ids",
            "txt_ids",
            "guidance",
            "return_dict",
        }
    )
    advice = {
        "joint_attention_kwargs": "attention-processor kwargs (a LoRA scale, IP-Adapter embeddings)"
        " are not applied; merge LoRA weights into the model (pipe.fuse_lora()) or " + RUN_ORDINARY,
        "controlnet_block_samples": _CONTROLNET,
        "controlnet_single_block_samples": _CONTROLNET,
        "controlnet_blocks_repeat": _CONTROLNET,
    }

    def __init__(self, attentions: list[FluxAttention]):
        super().__init__()
        self.attentions = attentions

    def run(self, module, ctx: ForwardContext, arguments: dict[str, Any]):
        _check_processors(self.attentions)
        inputs = {name: arguments[name] for name in self.implemented - {"return_dict"}}
        sample = run_flux(module, ctx, **inputs)
        if arguments["return_dict"]:
            return Transformer2DModelOutput(sample=sample)
        return (sample,)


def install_flux_hooks(transformer: torch.nn.Module) -> FluxInfo:
    """Check that ``transformer`` is made of the parts the mask-aware forward reimplements (else
    ``UnsupportedModelError``), lay each set of projections reading one input out in one weight
    storage (``fuse_linears``: no copy is kept) and patch its forward. Idempotent."""
    attentions = _check_structure(transformer)
    for projections in _projection_sets(transformer):
        fuse_linears(projections)
    registry = HookRegistry.check_if_exists_or_initialize(transformer)
    if registry.get_hook(HOOK_NAME) is None:
        registry.register_hook(_MaskAwareFluxHook(attentions), HOOK_NAME)
    return FluxInfo(len(transformer.transformer_blocks), len(transformer.single_transformer_blocks))


def _projection_sets(transformer) -> list[tuple[torch.nn.Module, ...]]:
    """Linears sharing an input, in the order the forward slices them: image q/k/v (k/v alone in
    hidden mode) and text q/k/v of double blocks; q/k/v/MLP of single blocks (k/v alone for the
    text of the last block)."""
    sets: list[tuple[torch.nn.Module, ...]] = []
    for block in transformer.transformer_blocks:
        attn = block.attn
        sets.append((attn.to_q, attn.to_k, attn.to_v))
        sets.append((attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
    for block in transformer.single_transformer_blocks:
        attn = block.attn
        sets.append((attn.to_q, attn.to_k, attn.to_v, block.proj_mlp))
    return sets


def _check_structure(transformer) -> list[FluxAttention]:
    """The attention modules of every block, after checking each part the forward reads inside."""
    require_type(transformer.pos_embed, (FluxPosEmbed,), "pos_embed")
    require_type(transformer.norm_out, (AdaLayerNormContinuous,), "norm_out")
    attentions = []
    for index, block in enumerate(transformer.transformer_blocks):
        where = f"transformer_blocks[{index}]"
        require_type(block, (FluxTransformerBlock,), where)
        for name in ("norm1", "norm1_context"):
            norm = getattr(block, name)
            require_type(norm, (AdaLayerNormZero,), f"{where}.{name}")
            require(norm.emb is None, f"{where}.{name}", "no embedding of its own")
        _check_attention(block.attn, f"{where}.attn", joint=True)
        attentions.append(block.attn)
    for index, block in enumerate(transformer.single_transformer_blocks):
        where = f"single_transformer_blocks[{index}]"
        require_type(block, (FluxSingleTransformerBlock,), where)
        require_type(block.norm, (AdaLayerNormZeroSingle,), f"{where}.norm")
        _check_attention(block.attn, f"{where}.attn", joint=False)
        attentions.append(block.attn)
    _check_processors(attentions)
    return attentions


def _check_attention(attn, where: str, joint: bool) -> None:
    require_type(attn, (FluxAttention,), where)
    norms = ("norm_q", "norm_k") + (("norm_added_q", "norm_added_k") if joint else ())
    for name in norms:
        require_type(getattr(attn, name), (torch.nn.RMSNorm,), f"{where}.{name}")
    if joint:
        require(
            attn.added_kv_proj_dim is not None and not attn.pre_only,
            where,
            "text projections and output projections (a double-stream block)",
        )
    else:
        require(attn.pre_only, where, "no output projection (a single-stream block)")


def _check_processors(attentions: list[FluxAttention]) -> None:
    """Also run on every mask-aware forward: processors can be swapped after install (IP-Adapter
    loading, ``set_attn_processor``) and the mask-aware forward would not run theirs."""
    for index, attn in enumerate(attentions):
        require_type(attn.processor, (FluxAttnProcessor,), f"attention {index}'s processor")


@dataclass
class _Shared:
    """Per-forward values every unit reads."""

    temb: torch.Tensor  # (rows, C)
    masked: RowLayout
    rope_text: torch.Tensor  # (T, 1, d/2, 2) rotations (cos, sin) of the text tokens
    rope_image: torch.Tensor  # (L, 1, d/2, 2) rotations of the image grid
    rope_masked: torch.Tensor  # (total, 1, d/2) complex rotations of the packed masked tokens
    ctx: ForwardContext
    last_unit: int  # after it the model drops the text tokens
    _rope_memo: dict = field(default_factory=dict)

    def rope_for(self, layout: RowLayout) -> torch.Tensor:
        """Rotations of a layout's packed tokens, at their own grid positions (memoised)."""
        if layout is self.masked:
            return self.rope_masked
        if id(layout) not in self._rope_memo:
            self._rope_memo[id(layout)] = self.rope_image.index_select(0, layout.packed_tokens)
        return self._rope_memo[id(layout)]


def _id_rotations(pos_embed, txt_ids: torch.Tensor, img_ids: torch.Tensor) -> torch.Tensor:
    """Rotations of [text ; image] ids. A request passes the same ids at every step, so they are
    computed once and kept on the image ids tensor (again once either is written to)."""
    if torch.compiler.is_compiling():  # a compiled step computes them in its graph
        return _rotations(*pos_embed(torch.cat((txt_ids, img_ids), dim=0)))
    state = (pos_embed, txt_ids, txt_ids._version, img_ids._version)
    kept = getattr(img_ids, "_maskserve_rotations", None)
    if kept is not None and all(a is b or a == b for a, b in zip(kept[0], state)):
        return kept[1]
    rotations = _rotations(*pos_embed(torch.cat((txt_ids, img_ids), dim=0)))
    img_ids._maskserve_rotations = (state, rotations)
    return rotations


def _rotations(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Flux's interleaved rotary (cos, sin) of shape (S, d), each value repeated for its pair of
    channels, as rotations (S, 1, d/2, 2): (cos, sin) pairs, the real and imaginary parts of
    complex rotations that broadcast over heads (``torch.view_as_complex`` of it is a view)."""
    return torch.stack((cos[:, 0::2].float(), sin[:, 0::2].float()), -1).unsqueeze(1)


def _rotate(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of (..., S, H, d) tokens as ONE complex multiply: channel pairs
    (2i, 2i+1) are the real and imaginary parts, as in diffusers' ``apply_rotary_emb`` (use_real,
    unbind -1). Compiled, the same product in real arithmetic, which the compiler fuses (it
    generates no code for complex numbers)."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    if torch.compiler.is_compiling():
        real, imag = pairs.unbind(-1)
        cos, sin = rotations.unbind(-1)
        rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), -1)
        return rotated.flatten(-2).to(x.dtype)
    rotated = torch.view_as_complex(pairs.contiguous()) * torch.view_as_complex(rotations)
    return torch.view_as_real(rotated).flatten(-2).to(x.dtype)


class _State:
    def __init__(self, full: torch.Tensor | None, packed: torch.Tensor | None):
        self.full, self.packed = full, packed


def run_flux(
    model,
    ctx: ForwardContext,
    hidden_states,
    encoder_hidden_states,
    pooled_projections,
    timestep,
    img_ids,
    txt_ids,
    guidance=None,
) -> torch.Tensor:
    num_rows, num_tokens, _ = hidden_states.shape
    ctx.require_rows(num_rows)
    if torch.compiler.is_compiling():  # the ids were built by the engine, its grids resolved
        grid = ctx.layouts.grid_of(num_tokens)
    else:
        grid = _image_grid(img_ids, txt_ids, num_tokens)
    timestep = timestep.to(hidden_states.dtype) * 1000
    if guidance is not None:
        temb = model.time_text_embed(
            timestep, guidance.to(hidden_states.dtype) * 1000, pooled_projections
        )
    else:
        temb = model.time_text_embed(timestep, pooled_projections)
    text = linear(ctx.lora, model.context_embedder, encoder_hidden_states, None)
    rotations = _id_rotations(model.pos_embed, txt_ids, img_ids)
    num_text = txt_ids.shape[0]
    masked = ctx.layout(grid)
    image = rotations[num_text:]
    shared = _Shared(
        temb,
        masked,
        rotations[:num_text],
        image,
        image.index_select(0, masked.packed_tokens),
        ctx,
        last_unit=len(model.transformer_blocks) + len(model.single_transformer_blocks) - 1,
    )
    if ctx.uses_cache(0) and ctx.mode == "kv":
        state = _State(
            None, linear(ctx.lora, model.x_embedder, masked.gather(hidden_states), masked)
        )
    else:
        state = _State(linear(ctx.lora, model.x_embedder, hidden_states, None), None)
    blocks = list(model.transformer_blocks) + list(model.single_transformer_blocks)
    for unit, block in enumerate(blocks):
        single = unit >= len(model.transformer_blocks)
        with ctx.timed_unit(unit):
            text, state = _run_unit(block, single, unit, state, text, shared)
    masked = shared.masked
    packed = state.packed if state.packed is not None else masked.gather(state.full)
    norm_out = model.norm_out
    scale, shift = (
        norm_out.linear(norm_out.silu(temb).to(temb.dtype)).to(packed.dtype).chunk(2, dim=1)
    )
    packed = _modulate(norm_out.norm(packed), masked, scale, shift)
    out = linear(ctx.lora, model.proj_out, packed, masked)
    return masked.scatter_into(out.new_zeros(num_rows, num_tokens, out.shape[-1]), out)


def _image_grid(img_ids: torch.Tensor, txt_ids: torch.Tensor, num_tokens: int) -> tuple[int, int]:
    """(rows, cols) of the token grid. Token masks are laid out row-major on it, so ``img_ids``
    must be exactly the (0, row, col) ids of that grid in row-major order, as the Flux pipelines
    build them; anything else (3-D ids, several images, shifted ids) is refused."""
    if img_ids.ndim != 2 or txt_ids.ndim != 2:
        raise UnsupportedForwardError(
            "the mask-aware Flux forward takes 2-D img_ids and txt_ids (one row of ids per token; "
            "diffusers deprecated the 3-D form): drop the batch dimension"
        )
    # A request passes the same ids at every step: checking them reads them back to the host (a
    # wait for the GPU), so a checked tensor remembers its grid until it is written to.
    checked = getattr(img_ids, "_maskserve_grid", None)
    if checked is not None and checked[0] == img_ids._version and img_ids.shape[0] == num_tokens:
        return checked[1]
    grid = (int(img_ids[:, 1].max()) + 1, int(img_ids[:, 2].max()) + 1)
    rows = torch.arange(grid[0], device=img_ids.device).repeat_interleave(grid[1])
    cols = torch.arange(grid[1], device=img_ids.device).repeat(grid[0])
    expected = torch.stack([torch.zeros_like(rows), rows, cols], dim=1).to(img_ids.dtype)
    if img_ids.shape != (num_tokens, 3) or not torch.equal(img_ids, expected):
        raise UnsupportedForwardError(
            f"img_ids must be the (0, row, col) ids of one row-major {grid[0]}x{grid[1]} token "
            f"grid with one row per image token ({num_tokens}), as FluxFillPipeline builds them: "
            "the mask-aware forward maps token masks onto that grid. " + RUN_ORDINARY
        )
    img_ids._maskserve_grid = (img_ids._version, grid)
    return grid


def _clip_half(x: torch.Tensor) -> torch.Tensor:
    """What the stock Flux blocks do to their float16 outputs (inf -> the largest finite value)."""
    return x.clip(-65504, 65504) if x.dtype == torch.float16 else x


def _run_unit(block, single: bool, unit: int, state: _State, text, shared: _Shared):
    ctx, masked = shared.ctx, shared.masked
    forward = _single_forward if single else _double_forward
    io = UnitIO(ctx, unit)
    text_needed = unit != shared.last_unit
    if not ctx.uses_cache(unit):
        if state.full is None:
            raise RuntimeError(f"unit {unit}: a dense unit cannot follow a cached unit in kv mode")
        dense = ctx.dense_layout(state.full.shape[1])
        around = _Around(
            shared.temb, shared.rope_text, shared.rope_for(dense), None, None, text_needed
        )
        x_flat = state.full.reshape(-1, state.full.shape[-1])
        text, out = forward(block, x_flat, dense, state.full, False, text, around, io)
        out_full = out.reshape(state.full.shape)
        ctx.record(unit, "out", out_full)
        return text, _State(out_full, None)
    ctx.cache.wait_for(unit)
    rope_q = shared.rope_for(masked)
    if ctx.mode == "kv":
        packed = state.packed if state.packed is not None else masked.gather(state.full)
        around = _Around(shared.temb, shared.rope_text, rope_q, None, None, text_needed)
        text, out = forward(block, packed, masked, None, True, text, around, io)
        return text, _State(None, out)
    dense = ctx.dense_layout(masked.num_tokens)
    around = _Around(
        shared.temb, shared.rope_text, rope_q, shared.rope_for(dense), dense, text_needed
    )
    text, out = forward(
        block, masked.gather(state.full), masked, state.full, False, text, around, io
    )
    return text, _State(ctx.merge_cached(unit, "out", masked, out), None)


@dataclass(frozen=True)
class _Around:
    """What a unit reads besides its tokens and the text: the step's time embedding, rotations of
    the text and of the unit's packed tokens, in hidden mode the rotations of every image token
    and the dense layout they are packed in, and whether the text's outputs are used after it
    (not after the last unit)."""

    temb: torch.Tensor
    rope_text: torch.Tensor
    rope_q: torch.Tensor
    rope_full: torch.Tensor | None
    dense: RowLayout | None
    text_needed: bool


def _modulate(
    normed: torch.Tensor, layout: RowLayout, scale: torch.Tensor, shift: torch.Tensor
) -> torch.Tensor:
    """AdaLN modulation of packed tokens: ``normed * (1 + scale) + shift`` with each token's row
    values."""
    modulated = torch.addcmul(
        layout.row_values(shift), layout.by_row(normed), layout.row_values(1 + scale)
    )
    return modulated.view(normed.shape)


def _gated(
    x: torch.Tensor, layout: RowLayout, gate: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """``x + gate * out`` of packed tokens with each token's row gate."""
    return torch.addcmul(layout.by_row(x), layout.row_values(gate), layout.by_row(out)).view(
        x.shape
    )


def _modulate_rows(normed: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """The same for tokens laid out per row, (rows, T, C)."""
    return torch.addcmul(shift[:, None], normed, (1 + scale)[:, None])


def _rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """diffusers ``RMSNorm`` (q/k norms) as one fused op."""
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps)


def _image_qkv(
    attn, normed: torch.Tensor, rotations: torch.Tensor, layout: RowLayout, lora, projected=None
):
    """Q, K, V (total, H, d) of packed image tokens (in ``layout``), after q/k RMS norm and rotary
    embedding. ``projected``: the caller's projections (q, k, v), or (k, v) when no queries are
    needed (Q is then None); when not given, q, k and v are projected here in one fused matmul."""
    if projected is None:
        projected = project(lora, normed, (attn.to_q, attn.to_k, attn.to_v), layout)
    *query, key, value = (p.unflatten(-1, (-1, attn.head_dim)) for p in projected)
    query = _rotate(_rms_norm(attn.norm_q, query[0]), rotations) if query else None
    return query, _rotate(_rms_norm(attn.norm_k, key), rotations), value


def _image_keys_for_groups(
    attn,
    key_q,
    value_q,
    layout_q: RowLayout,
    full_normed,
    from_cache: bool,
    around: _Around,
    io: UnitIO,
):
    """``group_kv(group, text_k, text_v)``: per row group, [text ; full image] K and V
    (g, T + L, H, d). Image K/V come from the queries themselves when dense, from the full normed
    input in hidden mode, or from the cache with the masked tokens replaced in kv mode."""
    if layout_q.is_full:
        key_full = key_q.reshape(layout_q.num_rows, layout_q.num_tokens, *key_q.shape[1:])
        value_full = value_q.reshape(key_full.shape)
    elif not from_cache:
        dense = around.dense
        full_flat = full_normed.reshape(-1, full_normed.shape[-1])
        _, key_flat, value_flat = _image_qkv(
            attn,
            full_flat,
            around.rope_full,
            dense,
            io.lora,
            project(io.lora, full_flat, (attn.to_k, attn.to_v), dense),
        )
        key_full = key_flat.reshape(layout_q.num_rows, layout_q.num_tokens, *key_flat.shape[1:])
        value_full = value_flat.reshape(key_full.shape)
    else:

        def group_kv(group, text_k, text_v):
            if group == (0, layout_q.num_rows):  # every row at once (padded attention)
                return (
                    io.merge_after("k", layout_q, key_q, text_k),
                    io.merge_after("v", layout_q, value_q, text_v),
                )
            key = io.merge_group_after(
                "k", layout_q, group, layout_q.group_tokens(key_q, group), text_k
            )
            value = io.merge_group_after(
                "v", layout_q, group, layout_q.group_tokens(value_q, group), text_v
            )
            return key, value

        return group_kv
    io.record("k", key_full.flatten(2))
    io.record("v", value_full.flatten(2))
    return lambda group, text_k, text_v: (
        torch.cat([text_k, key_full[group[0] : group[1]]], dim=1),
        torch.cat([text_v, value_full[group[0] : group[1]]], dim=1),
    )


def _joint_attention(text_q, text_k, text_v, query, layout_q: RowLayout, group_kv, padded):
    """Per row group (or, ``padded``, every row in one call with its image queries padded to the
    longest row's: ``ragged_attention``): [text ; masked image] queries over [text ; all image]
    keys. Returns text outputs (rows, T, H*d) and packed image outputs (total, H*d). With
    ``text_q`` None only the image tokens query (text outputs are None)."""
    num_text = 0 if text_q is None else text_q.shape[1]
    if layout_q.regular or (padded and len(layout_q.groups) > 1):
        key, value = group_kv((0, layout_q.num_rows), text_k, text_v)
        queries = pad_rows(query, layout_q)
        if text_q is not None:
            queries = torch.cat([text_q, queries], dim=1)
        out = attend(queries, key, value)
        image_out = unpad_rows(out[:, num_text:], layout_q).flatten(1)
        return (None if text_q is None else out[:, :num_text].flatten(2)), image_out
    text_out, image_out = [], []
    for start, stop in layout_q.groups:
        key, value = group_kv((start, stop), text_k[start:stop], text_v[start:stop])
        queries = layout_q.group_tokens(query, (start, stop))
        if text_q is not None:
            queries = torch.cat([text_q[start:stop], queries], dim=1)
        out = attend(queries, key, value)
        text_out.append(out[:, :num_text].flatten(2))
        image_out.append(out[:, num_text:].flatten(2).flatten(0, 1))
    return (None if text_q is None else cat_once(text_out)), cat_once(image_out)


def _text_qkv(attn, normed_text, rope_text, added: bool, lora, projected=None):
    """Q, K, V (rows, T, H, d) of the text tokens (always computed), normed and rotated.
    ``projected``: the caller's projections, either (q, k, v) or (k, v) only (Q is then None)."""
    head_dim = attn.head_dim
    if added:
        projections = (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
        norms = (attn.norm_added_q, attn.norm_added_k)
    else:
        projections = (attn.to_q, attn.to_k, attn.to_v)
        norms = (attn.norm_q, attn.norm_k)
    if projected is None:
        projected = project(lora, normed_text, projections, None)
    *query, key, value = (p.unflatten(-1, (-1, head_dim)) for p in projected)
    query = _rotate(_rms_norm(norms[0], query[0]), rope_text) if query else None
    return query, _rotate(_rms_norm(norms[1], key), rope_text), value


def _double_forward(block, x_q, layout_q, x_full, from_cache, text, around: _Around, io):
    temb = around.temb
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.norm1.linear(
        block.norm1.silu(temb)
    ).chunk(6, dim=1)
    normed_q = _modulate(block.norm1.norm(x_q), layout_q, scale_msa, shift_msa)
    normed_full = None
    if x_full is not None and not layout_q.is_full:
        normed_full = _modulate_rows(block.norm1.norm(x_full), scale_msa, shift_msa)
    normed_text, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = block.norm1_context(
        text, emb=temb
    )
    attn, lora = block.attn, io.lora
    query, key_q, value_q = _image_qkv(attn, normed_q, around.rope_q, layout_q, lora)
    group_kv = _image_keys_for_groups(
        attn, key_q, value_q, layout_q, normed_full, from_cache, around, io
    )
    text_q, text_k, text_v = _text_qkv(attn, normed_text, around.rope_text, True, lora)
    text_attn, image_attn = _joint_attention(
        text_q, text_k, text_v, query, layout_q, group_kv, io.padded
    )
    image_out = linear(lora, attn.to_out[0], image_attn, layout_q)
    hidden = _gated(x_q, layout_q, gate_msa, image_out)
    normed = _modulate(block.norm2(hidden), layout_q, scale_mlp, shift_mlp)
    mlp = feed_forward(lora, block.ff, normed, layout_q)
    hidden = _gated(hidden, layout_q, gate_mlp, mlp)
    text_out = linear(lora, attn.to_add_out, text_attn, None)
    text = torch.addcmul(text, c_gate_msa.unsqueeze(1), text_out)
    normed_text = _modulate_rows(block.norm2_context(text), c_scale_mlp, c_shift_mlp)
    text_mlp = feed_forward(lora, block.ff_context, normed_text, None)
    text = torch.addcmul(text, c_gate_mlp.unsqueeze(1), text_mlp)
    return _clip_half(text), hidden


def _single_forward(block, x_q, layout_q, x_full, from_cache, text, around: _Around, io):
    """Single-stream block. Text and masked image tokens share every linear, so they run as one
    packed sequence [text of every row ; masked image tokens] through one fused q/k/v/MLP matmul.
    In the last unit text tokens only serve as keys and values: the model drops their outputs
    after it, so their queries, MLP and output projection are skipped (the image outputs are
    unchanged)."""
    temb = around.temb
    shift, scale, gate = block.norm.linear(block.norm.silu(temb)).chunk(3, dim=1)
    normed_q = _modulate(block.norm.norm(x_q), layout_q, scale, shift)
    normed_full = None
    if x_full is not None and not layout_q.is_full:
        normed_full = _modulate_rows(block.norm.norm(x_full), scale, shift)
    normed_text = _modulate_rows(block.norm.norm(text), scale, shift)
    attn, lora = block.attn, io.lora
    num_rows, num_text, width = text.shape
    split = num_rows * num_text
    image_linears = (attn.to_q, attn.to_k, attn.to_v, block.proj_mlp)
    text_needed = around.text_needed
    if text_needed:
        # one packed sequence [every row's text ; masked image tokens]
        rows = lora.text_then_packed(text, layout_q) if lora is not None else None
        projected = project(
            lora, torch.cat([normed_text.reshape(-1, width), normed_q]), image_linears, rows
        )
        image_projected = [p[split:] for p in projected]
        text_projected = [p[:split].reshape(num_rows, num_text, -1) for p in projected[:3]]
    else:
        rows = layout_q
        image_projected = project(lora, normed_q, image_linears, layout_q)
        text_projected = project(lora, normed_text, (attn.to_k, attn.to_v), None)
    query, key_q, value_q = _image_qkv(
        attn, normed_q, around.rope_q, layout_q, lora, image_projected[:3]
    )
    group_kv = _image_keys_for_groups(
        attn, key_q, value_q, layout_q, normed_full, from_cache, around, io
    )
    text_q, text_k, text_v = _text_qkv(
        attn, normed_text, around.rope_text, False, lora, projected=text_projected
    )
    text_attn, image_attn = _joint_attention(
        text_q, text_k, text_v, query, layout_q, group_kv, io.padded
    )
    mlp = block.act_mlp(projected[3] if text_needed else image_projected[3])
    attn_rows = torch.cat([text_attn.reshape(split, -1), image_attn]) if text_needed else image_attn
    mixed = linear(lora, block.proj_out, torch.cat([attn_rows, mlp], dim=-1), rows)
    if not text_needed:
        return text, _clip_half(_gated(x_q, layout_q, gate, mixed))
    hidden = _gated(x_q, layout_q, gate, mixed[split:])
    text = torch.addcmul(text, gate.unsqueeze(1), mixed[:split].reshape(num_rows, num_text, width))
    return _clip_half(text), _clip_half(hidden)

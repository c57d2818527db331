"""Mask-aware execution of a diffusers ``FluxTransformer2DModel`` (Flux Fill).

Units are the double-stream blocks then the single-stream blocks (one stack). Image tokens of
every row are gathered right after the patch embedding into one packed sequence; every linear,
norm, modulation and MLP then runs on masked tokens only. Text tokens are always computed.
Attention: masked image queries and all text queries attend over [text K/V ; image K/V], where the
image K/V of unmasked tokens come from the cache (``kv`` mode, K cached after its RMS norm and
rotary embedding) or are projected from the full hidden input (``hidden`` mode, whose unmasked
output rows come from the cache). The model output is scattered back to the full token grid;
rows of unmasked tokens are zero (the engine takes them from the template trajectory).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.modeling_outputs import Transformer2DModelOutput

from backend.engine.attention import attend, fused_linear
from backend.engine.context import ForwardContext, cat_once, current_context
from backend.engine.layout import RowLayout

HOOK_NAME = "maskserve_flux"


@dataclass(frozen=True)
class FluxInfo:
    num_double: int
    num_single: int

    @property
    def num_units(self) -> int:
        return self.num_double + self.num_single


class _MaskAwareFluxHook(ModelHook):
    def __init__(self, info: FluxInfo):
        super().__init__()
        self.info = info

    def new_forward(self, module, *args, **kwargs):
        ctx = current_context()
        if ctx is None:
            return self.fn_ref.original_forward(*args, **kwargs)
        sample = run_flux(module, ctx, **kwargs)
        if kwargs.get("return_dict", True):
            return Transformer2DModelOutput(sample=sample)
        return (sample,)


def install_flux_hooks(transformer: torch.nn.Module) -> FluxInfo:
    info = FluxInfo(len(transformer.transformer_blocks), len(transformer.single_transformer_blocks))
    registry = HookRegistry.check_if_exists_or_initialize(transformer)
    if registry.get_hook(HOOK_NAME) is None:
        registry.register_hook(_MaskAwareFluxHook(info), HOOK_NAME)
    return info


@dataclass
class _Shared:
    """Per-forward values every unit reads."""

    temb: torch.Tensor  # (rows, C)
    masked: RowLayout
    rope_text: tuple[torch.Tensor, torch.Tensor]  # (T, d) cos, sin
    rope_image: tuple[torch.Tensor, torch.Tensor]  # (L, d) cos, sin
    rope_masked: tuple[torch.Tensor, torch.Tensor]  # (total, d) cos, sin of the packed masked tokens
    ctx: ForwardContext
    _rope_memo: dict = field(default_factory=dict)

    def rope_for(self, layout: RowLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotary (cos, sin) of a layout's packed tokens, at their own grid positions (memoised)."""
        if layout is self.masked:
            return self.rope_masked
        if id(layout) not in self._rope_memo:
            positions = torch.cat(layout.indices)
            self._rope_memo[id(layout)] = (self.rope_image[0].index_select(0, positions),
                                           self.rope_image[1].index_select(0, positions))
        return self._rope_memo[id(layout)]


class _State:
    def __init__(self, full: torch.Tensor | None, packed: torch.Tensor | None):
        self.full, self.packed = full, packed


def run_flux(model, ctx: ForwardContext, hidden_states, encoder_hidden_states, pooled_projections, timestep,
             img_ids, txt_ids, guidance=None, return_dict=True, **_unused) -> torch.Tensor:
    num_rows, num_tokens, _ = hidden_states.shape
    grid = (int(img_ids[:, 1].max()) + 1, int(img_ids[:, 2].max()) + 1)
    timestep = timestep.to(hidden_states.dtype) * 1000
    if guidance is not None:
        temb = model.time_text_embed(timestep, guidance.to(hidden_states.dtype) * 1000, pooled_projections)
    else:
        temb = model.time_text_embed(timestep, pooled_projections)
    text = model.context_embedder(encoder_hidden_states)
    cos, sin = model.pos_embed(torch.cat((txt_ids, img_ids), dim=0))
    num_text = txt_ids.shape[0]
    masked = ctx.layout(grid)
    positions = torch.cat(masked.indices)
    image_cos, image_sin = cos[num_text:], sin[num_text:]
    shared = _Shared(temb, masked, (cos[:num_text], sin[:num_text]), (image_cos, image_sin),
                     (image_cos.index_select(0, positions), image_sin.index_select(0, positions)), ctx)
    if ctx.uses_cache(0) and ctx.mode == "kv":
        state = _State(None, model.x_embedder(shared.masked.gather(hidden_states)))
    else:
        state = _State(model.x_embedder(hidden_states), None)
    blocks = list(model.transformer_blocks) + list(model.single_transformer_blocks)
    for unit, block in enumerate(blocks):
        single = unit >= len(model.transformer_blocks)
        with ctx.timed_unit(unit):
            text, state = _run_unit(block, single, unit, state, text, shared)
    masked = shared.masked
    packed = state.packed if state.packed is not None else masked.gather(state.full)
    norm_out = model.norm_out
    scale, shift = norm_out.linear(norm_out.silu(temb).to(temb.dtype)).to(packed.dtype).chunk(2, dim=1)
    packed = norm_out.norm(packed) * (1 + masked.expand_rows(scale)) + masked.expand_rows(shift)
    out = model.proj_out(packed)
    return masked.scatter_into(out.new_zeros(num_rows, num_tokens, out.shape[-1]), out)


def _run_unit(block, single: bool, unit: int, state: _State, text, shared: _Shared):
    ctx, masked = shared.ctx, shared.masked
    forward = _single_forward if single else _double_forward
    if not ctx.uses_cache(unit):
        if state.full is None:
            raise RuntimeError(f"unit {unit}: a dense unit cannot follow a cached unit in kv mode")
        dense = ctx.dense_layout(state.full.shape[1])
        text, out = forward(block, unit, state.full.reshape(-1, state.full.shape[-1]), dense, state.full, False,
                            text, shared)
        out_full = out.reshape(state.full.shape)
        ctx.record(unit, "out", out_full)
        return text, _State(out_full, None)
    ctx.cache.wait_for(unit)
    if ctx.mode == "kv":
        packed = state.packed if state.packed is not None else masked.gather(state.full)
        text, out = forward(block, unit, packed, masked, None, True, text, shared)
        return text, _State(None, out)
    text, out = forward(block, unit, masked.gather(state.full), masked, state.full, False, text, shared)
    return text, _State(ctx.merge_cached(unit, "out", masked, out), None)


def _modulate(normed: torch.Tensor, layout: RowLayout, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    return normed * (1 + layout.expand_rows(scale)) + layout.expand_rows(shift)


def _rope_packed(x: torch.Tensor, freqs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotary embedding of packed tokens (total, H, d) given their (cos, sin) rows."""
    return apply_rotary_emb(x.unsqueeze(0), freqs, sequence_dim=1).squeeze(0)


def _image_qkv(attn, normed: torch.Tensor, freqs: tuple[torch.Tensor, torch.Tensor], projected=None):
    """Q, K, V (total, H, d) of packed image tokens, after q/k RMS norm and rotary embedding.
    ``projected``: the q, k, v projections when the caller already ran them (fused)."""
    head_dim = attn.head_dim
    if projected is None:
        projected = fused_linear(normed, (attn.to_q, attn.to_k, attn.to_v))
    query, key, value = (p.unflatten(-1, (-1, head_dim)) for p in projected)
    query, key = attn.norm_q(query), attn.norm_k(key)
    return _rope_packed(query, freqs), _rope_packed(key, freqs), value


def _image_keys_for_groups(attn, key_q, value_q, layout_q: RowLayout, full_normed, from_cache: bool, unit: int,
                           shared: _Shared):
    """``group_kv(group, text_k, text_v)``: per row group, [text ; full image] K and V (g, T + L, H, d).
    Image K/V come from the queries themselves when dense, from the full normed input in hidden mode,
    or from the cache with the masked tokens replaced in kv mode."""
    ctx = shared.ctx
    if layout_q.is_full:
        key_full = key_q.reshape(layout_q.num_rows, layout_q.num_tokens, *key_q.shape[1:])
        value_full = value_q.reshape(key_full.shape)
    elif not from_cache:
        dense = ctx.dense_layout(layout_q.num_tokens)
        _, key_flat, value_flat = _image_qkv(attn, full_normed.reshape(-1, full_normed.shape[-1]),
                                             shared.rope_for(dense))
        key_full = key_flat.reshape(layout_q.num_rows, layout_q.num_tokens, *key_flat.shape[1:])
        value_full = value_flat.reshape(key_full.shape)
    else:
        def group_kv(group, text_k, text_v):
            key = ctx.merge_group_after(unit, "k", layout_q, group, layout_q.group_tokens(key_q, group), text_k)
            value = ctx.merge_group_after(unit, "v", layout_q, group, layout_q.group_tokens(value_q, group), text_v)
            return key, value
        return group_kv
    ctx.record(unit, "k", key_full.flatten(2))
    ctx.record(unit, "v", value_full.flatten(2))
    return lambda group, text_k, text_v: (torch.cat([text_k, key_full[group[0]:group[1]]], dim=1),
                                          torch.cat([text_v, value_full[group[0]:group[1]]], dim=1))


def _joint_attention(text_q, text_k, text_v, query, layout_q: RowLayout, group_kv):
    """Per row group: [text ; masked image] queries over [text ; all image] keys. Returns text
    outputs (rows, T, H*d) and packed image outputs (total, H*d)."""
    num_text = text_q.shape[1]
    text_out, image_out = [], []
    for start, stop in layout_q.groups:
        key, value = group_kv((start, stop), text_k[start:stop], text_v[start:stop])
        out = attend(torch.cat([text_q[start:stop], layout_q.group_tokens(query, (start, stop))], dim=1), key, value)
        text_out.append(out[:, :num_text].flatten(2))
        image_out.append(out[:, num_text:].flatten(2).flatten(0, 1))
    return cat_once(text_out), cat_once(image_out)


def _text_qkv(attn, normed_text, rope_text, added: bool, projected=None):
    """Q, K, V (rows, T, H, d) of the text tokens (always computed), normed and rotated."""
    head_dim = attn.head_dim
    if added:
        projections = (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
        norms = (attn.norm_added_q, attn.norm_added_k)
    else:
        projections = (attn.to_q, attn.to_k, attn.to_v)
        norms = (attn.norm_q, attn.norm_k)
    if projected is None:
        projected = fused_linear(normed_text, projections)
    query, key, value = (p.unflatten(-1, (-1, head_dim)) for p in projected)
    query, key = norms[0](query), norms[1](key)
    query = apply_rotary_emb(query, rope_text, sequence_dim=1)
    key = apply_rotary_emb(key, rope_text, sequence_dim=1)
    return query, key, value


def _double_forward(block, unit, x_q, layout_q, x_full, from_cache, text, shared: _Shared):
    temb = shared.temb
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.norm1.linear(
        block.norm1.silu(temb)).chunk(6, dim=1)
    normed_q = _modulate(block.norm1.norm(x_q), layout_q, scale_msa, shift_msa)
    normed_full = None
    if x_full is not None and not layout_q.is_full:
        normed_full = block.norm1.norm(x_full) * (1 + scale_msa[:, None]) + shift_msa[:, None]
    normed_text, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = block.norm1_context(text, emb=temb)
    attn = block.attn
    query, key_q, value_q = _image_qkv(attn, normed_q, shared.rope_for(layout_q))
    group_kv = _image_keys_for_groups(attn, key_q, value_q, layout_q, normed_full, from_cache, unit, shared)
    text_q, text_k, text_v = _text_qkv(attn, normed_text, shared.rope_text, added=True)
    text_attn, image_attn = _joint_attention(text_q, text_k, text_v, query, layout_q, group_kv)
    hidden = x_q + layout_q.expand_rows(gate_msa) * attn.to_out[0](image_attn)
    normed = _modulate(block.norm2(hidden), layout_q, scale_mlp, shift_mlp)
    hidden = hidden + layout_q.expand_rows(gate_mlp) * block.ff(normed)
    text = text + c_gate_msa.unsqueeze(1) * attn.to_add_out(text_attn)
    normed_text = block.norm2_context(text) * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
    text = text + c_gate_mlp.unsqueeze(1) * block.ff_context(normed_text)
    return text, hidden


def _single_forward(block, unit, x_q, layout_q, x_full, from_cache, text, shared: _Shared):
    """Single-stream block. Text and masked image tokens share every linear, so they run as one
    packed sequence [text of every row ; masked image tokens] through one fused q/k/v/MLP matmul."""
    temb = shared.temb
    shift, scale, gate = block.norm.linear(block.norm.silu(temb)).chunk(3, dim=1)
    normed_q = _modulate(block.norm.norm(x_q), layout_q, scale, shift)
    normed_full = None
    if x_full is not None and not layout_q.is_full:
        normed_full = block.norm.norm(x_full) * (1 + scale[:, None]) + shift[:, None]
    normed_text = block.norm.norm(text) * (1 + scale[:, None]) + shift[:, None]
    attn = block.attn
    num_rows, num_text, width = text.shape
    tokens = torch.cat([normed_text.reshape(-1, width), normed_q])
    projected = fused_linear(tokens, (attn.to_q, attn.to_k, attn.to_v, block.proj_mlp))
    split = num_rows * num_text
    query, key_q, value_q = _image_qkv(attn, normed_q, shared.rope_for(layout_q), [p[split:] for p in projected[:3]])
    group_kv = _image_keys_for_groups(attn, key_q, value_q, layout_q, normed_full, from_cache, unit, shared)
    text_q, text_k, text_v = _text_qkv(attn, normed_text, shared.rope_text, added=False,
                                       projected=[p[:split].reshape(num_rows, num_text, -1) for p in projected[:3]])
    text_attn, image_attn = _joint_attention(text_q, text_k, text_v, query, layout_q, group_kv)
    mixed = block.proj_out(torch.cat([torch.cat([text_attn.reshape(split, -1), image_attn]),
                                      block.act_mlp(projected[3])], dim=-1))
    hidden = x_q + layout_q.expand_rows(gate) * mixed[split:]
    text = text + gate.unsqueeze(1) * mixed[:split].reshape(num_rows, num_text, width)
    return text, hidden

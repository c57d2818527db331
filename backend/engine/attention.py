"""Ragged attention, and the fused projections that feed it.

Queries arrive packed ``(total, heads, head_dim)`` (see ``layout.RowLayout``); keys and values are
assembled per row by the caller, so rows with different masks, templates and steps share one call.
Projections reading one input (q/k/v, and Flux's MLP input) share one weight storage laid out at
install (``fuse_linears``), so ``fused_linear`` runs them as one matmul without a second copy of
any weight.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from backend.engine.layout import RowLayout

# How the rows of a batch share attention (``EngineSettings.attention``): see ``ragged_attention``
ATTENTION_BATCHING = ("auto", "grouped", "padded")

Group = tuple[int, int]
KVForGroup = Callable[[Group], tuple[torch.Tensor, torch.Tensor]]


def check_attention_batching(choice: str) -> str:
    if choice not in ATTENTION_BATCHING:
        raise ValueError(f"attention {choice!r} is not known: use {', '.join(ATTENTION_BATCHING)}")
    return choice


def pads_attention(choice: str, device: torch.device) -> bool:
    """Whether a batch on ``device`` runs padded attention: ``auto`` pads on CUDA, whose steps are
    bound by launching operators, not on the CPU, which would compute the padding."""
    return choice == "padded" or (choice == "auto" and device.type == "cuda")


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """(g, n, H, d) x (g, m, H, d) x (g, m, H, d) -> (g, n, H, d) scaled dot-product attention."""
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    )
    return out.transpose(1, 2)


def ragged_attention(
    query: torch.Tensor, layout: RowLayout, kv_for_group: KVForGroup, padded: bool = False
) -> torch.Tensor:
    """Packed queries (total, H, d) -> packed outputs, with keys/values ``kv_for_group(rows)`` of
    shape (g, m, H, d) for the rows ``range(*rows)`` (m the same for every row).

    Grouped (the default): each group of rows that select the same tokens runs as one call, so no
    query is computed twice or padded. ``padded``: every row in one call, each row's queries padded
    to the longest row's (``padded_attention``): a fixed number of operators per layer whatever
    the batch, for devices bound by launching operators rather than by their arithmetic."""
    if layout.regular or (padded and len(layout.groups) > 1):
        key, value = kv_for_group((0, layout.num_rows))
        return padded_attention(query, layout, key, value)
    outputs = []
    for group in layout.groups:
        q = layout.group_tokens(query, group)
        if q.shape[1] == 0:
            continue
        key, value = kv_for_group(group)
        outputs.append(attend(q, key, value).reshape(-1, *query.shape[1:]))
    if not outputs:
        return query.new_zeros(query.shape)
    return torch.cat(outputs, dim=0)


def padded_attention(
    query: torch.Tensor, layout: RowLayout, key: torch.Tensor, value: torch.Tensor
) -> torch.Tensor:
    """Packed queries (total, H, d) of every row against that row's keys/values (rows, m, H, d),
    in one call (``pad_rows``; a padded query only reads keys, so it changes no real output)."""
    return unpad_rows(attend(pad_rows(query, layout), key, value), layout)


def pad_rows(packed: torch.Tensor, layout: RowLayout) -> torch.Tensor:
    """Packed (total, ...) -> (rows, longest row, ...): each row's tokens first, then zeros."""
    rows, width, per_token = layout.num_rows, layout.max_tokens, packed.shape[1:]
    if layout.padded_index is None:  # every row is the longest: the packed tensor is the padded one
        return packed.reshape(rows, width, *per_token)
    padded = packed.new_zeros((rows * width, *per_token))
    return padded.index_copy_(0, layout.padded_index, packed).reshape(rows, width, *per_token)


def unpad_rows(padded: torch.Tensor, layout: RowLayout) -> torch.Tensor:
    """(rows, longest row, ...) -> packed (total, ...): the padding dropped."""
    flat = padded.reshape(-1, *padded.shape[2:])
    return flat if layout.padded_index is None else flat.index_select(0, layout.padded_index)


def replace_rows(base: torch.Tensor, indices: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """Copy of ``base`` (g, L, ...) with tokens ``indices`` replaced by ``fresh`` (g, n, ...); key
    order is kept, so attention over the result matches dense attention when nothing changed."""
    return base.to(fresh.dtype).index_copy(1, indices, fresh)


def fuse_linears(modules: Sequence[torch.nn.Module]) -> bool:
    """Lay the weights (and biases) of linears that read one input out in ONE storage, rows in the
    given order, and re-point each module's ``weight``/``bias`` Parameter at its rows (views: the
    originals are released, so the model's unique parameter bytes do not grow). Afterwards
    ``fused_linear`` over the set, or over any run of consecutive modules of it, is one matmul.

    Idempotent. Parameter names, values and ``requires_grad`` are unchanged. Returns False and
    leaves the modules as they are when they cannot share one storage (dtypes, devices or input
    widths differ, or only some have a bias); ``fused_linear`` then runs one matmul per module.
    """
    linears = _plain_linears(modules)
    fused = _fused_parameters(linears)
    if fused is not None:
        _remember_rows(linears, *fused)
        return True
    with_bias = [m.bias is not None for m in linears]
    layouts = {(m.weight.dtype, m.weight.device, m.in_features) for m in linears}
    if len(layouts) != 1 or len(set(with_bias)) != 1:
        return False
    with torch.no_grad():
        weight = torch.cat([m.weight for m in linears])
        bias = torch.cat([m.bias for m in linears]) if with_bias[0] else None
    start = 0
    for m in linears:
        stop = start + m.out_features
        m.weight = torch.nn.Parameter(weight[start:stop], requires_grad=m.weight.requires_grad)
        if bias is not None:
            m.bias = torch.nn.Parameter(bias[start:stop], requires_grad=m.bias.requires_grad)
        start = stop
    _remember_rows(linears, weight.detach(), None if bias is None else bias.detach())
    return True


def _remember_rows(linears: list[torch.nn.Linear], weight, bias) -> None:
    """Keep on each module the set's shared (weight, bias) and the module's rows in them, for
    ``fused_linear`` inside a compiled graph (which cannot compare storage addresses)."""
    start = 0
    for m in linears:
        m._maskserve_rows = (weight, bias, start, start + m.out_features)
        start += m.out_features


def fused_linear(x: torch.Tensor, modules: Sequence[torch.nn.Module]) -> tuple[torch.Tensor, ...]:
    """Outputs of several ``nn.Linear`` reading the same input ``x``, one per module.

    One matmul over the modules' shared storage when ``fuse_linears`` laid them out together and
    they still are (nothing moved or replaced a weight since); otherwise each module is called, so
    its hooks run and nothing is copied. Autograd through weights that require grad also takes the
    per-module path (the fused view is detached). Raises ``TypeError`` for any module that is not
    exactly ``torch.nn.Linear`` (LoRA, quantized or other wrapped layers compute something else).
    """
    linears = _plain_linears(modules)
    fused = _remembered(linears) if torch.compiler.is_compiling() else _fused_parameters(linears)
    if fused is None or _has_forward_hooks(linears) or _needs_weight_grad(linears):
        return tuple(m(x) for m in linears)
    weight, bias = fused
    return F.linear(x, weight, bias).split([m.out_features for m in linears], dim=-1)


def _remembered(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, bias) rows of consecutive modules of one set laid out by ``fuse_linears``, from
    what it remembered (a compiled graph's form of ``_fused_parameters``: the engine owns the
    model and moves no weight once installed)."""
    rows = [getattr(m, "_maskserve_rows", None) for m in linears]
    if any(r is None for r in rows):
        return None
    weight, bias = rows[0][0], rows[0][1]
    for previous, current in zip(rows, rows[1:]):
        if current[0] is not weight or current[2] != previous[3]:
            return None
    start, stop = rows[0][2], rows[-1][3]
    return weight[start:stop], None if bias is None else bias[start:stop]


def _plain_linears(modules: Sequence[torch.nn.Module]) -> list[torch.nn.Linear]:
    for m in modules:
        if type(m) is not torch.nn.Linear:
            raise TypeError(
                f"mask-aware projections take plain torch.nn.Linear layers, got "
                f"{type(m).__module__}.{type(m).__qualname__}: merge adapters into the weights "
                "(e.g. pipe.fuse_lora(); pipe.unload_lora_weights()) and load unquantized weights "
                "before installing the engine, or run the ordinary pipeline"
            )
    return list(modules)  # type: ignore[arg-type]


def _fused_parameters(
    linears: list[torch.nn.Linear],
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, bias) views spanning the modules' rows when they lie back to back, in order, in the
    storage of the first module's weight (and bias); None otherwise."""
    weight = _rows_view([m.weight for m in linears])
    if weight is None:
        return None
    biases = [m.bias for m in linears]
    if all(b is None for b in biases):
        return weight, None
    if any(b is None for b in biases):
        return None
    bias = _rows_view(biases)  # type: ignore[arg-type]
    return None if bias is None else (weight, bias)


def _rows_view(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """A view (rows, ...) over ``parts`` when each is contiguous and starts where the previous one
    ends, all inside the first part's storage (so they are that storage, not neighbours in
    memory); None otherwise."""
    first = parts[0]
    address, rows = first.data_ptr(), 0
    for part in parts:
        if (
            part.dtype != first.dtype
            or part.device != first.device
            or part.shape[1:] != first.shape[1:]
            or not part.is_contiguous()
            or part.data_ptr() != address
        ):
            return None
        address += part.numel() * part.element_size()
        rows += part.shape[0]
    span = address - first.data_ptr() + first.storage_offset() * first.element_size()
    if span > first.untyped_storage().nbytes():
        return None
    shape = (rows, *first.shape[1:])
    return first.detach().as_strided(shape, first.stride(), first.storage_offset())


def _has_forward_hooks(linears: list[torch.nn.Linear]) -> bool:
    """Hooks (offloading, adapters) act in the module's call, which the fused matmul skips."""
    return any(m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__ for m in linears)


def _needs_weight_grad(linears: list[torch.nn.Linear]) -> bool:
    return torch.is_grad_enabled() and any(p.requires_grad for m in linears for p in m.parameters())

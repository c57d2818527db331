"""The mask-aware forwards refuse what they do not implement, and fused projections keep one copy
of their weights (built from the tiny configs with random weights: no pipeline needed)."""

from __future__ import annotations

import pytest
import torch
from diffusers import FluxTransformer2DModel, UNet2DConditionModel
from diffusers.models.attention_processor import AttnProcessor
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor
from torch.utils._python_dispatch import TorchDispatchMode

from backend.engine.attention import fuse_linears, fused_linear
from backend.engine.context import ForwardContext, active_context
from backend.engine.flux import install_flux_hooks
from backend.engine.strict import UnsupportedForwardError, UnsupportedModelError
from backend.engine.unet import install_unet_hooks, unet_stacks
from backend.models.configs import CONFIGS

GRID = (4, 4)  # Flux token grid of the test inputs
TEXT_TOKENS = 3


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _matmuls(fn) -> int:
    with _CountMatmuls() as counter:
        fn()
    return counter.calls


def _unique_storage_bytes(module: torch.nn.Module) -> int:
    storages = {t.untyped_storage().data_ptr(): t for t in module.state_dict().values()}
    return sum(t.untyped_storage().nbytes() for t in storages.values())


def _linears():
    torch.manual_seed(0)
    return [torch.nn.Linear(8, n) for n in (8, 8, 8, 16)]


# ----- fused projections ------------------------------------------------------------------------
@torch.no_grad()
def test_fusing_repoints_weights_into_one_storage_without_growing():
    linears = _linears()
    x = torch.randn(5, 8)
    before = [m(x) for m in linears]
    params_before = sum(p.numel() for m in linears for p in m.parameters())
    assert fuse_linears(linears)
    q, k, v, mlp = linears
    assert k.weight.data_ptr() == q.weight.data_ptr() + 8 * 8 * 4
    assert mlp.bias.data_ptr() == q.bias.data_ptr() + 3 * 8 * 4
    assert len({m.weight.untyped_storage().data_ptr() for m in linears}) == 1
    storage_bytes = q.weight.untyped_storage().nbytes() + q.bias.untyped_storage().nbytes()
    assert storage_bytes == params_before * 4  # one copy of every weight and bias, nothing more
    assert all(isinstance(p, torch.nn.Parameter) for m in linears for p in m.parameters())
    for out, expected in zip(fused_linear(x, linears), before):
        assert torch.allclose(out, expected, atol=1e-6)
    assert fuse_linears(linears) and q.weight.untyped_storage().nbytes() == 40 * 8 * 4  # idempotent


@torch.no_grad()
def test_fused_sets_and_their_runs_are_one_matmul():
    linears = _linears()
    fuse_linears(linears)
    q, k, v, mlp = linears
    x = torch.randn(5, 8)
    assert _matmuls(lambda: fused_linear(x, linears)) == 1
    assert _matmuls(lambda: fused_linear(x, (k, v))) == 1
    key, value = fused_linear(x, (k, v))
    assert torch.allclose(key, k(x), atol=1e-6) and torch.allclose(value, v(x), atol=1e-6)
    assert _matmuls(lambda: fused_linear(x, (q, v))) == 2  # not adjacent: one matmul each


@torch.no_grad()
def test_fused_matmul_sees_in_place_changes_and_replaced_weights_split_it():
    linears = _linears()
    fuse_linears(linears)
    q, k, v, mlp = linears
    x = torch.randn(5, 8)
    k.weight.mul_(2.0)  # in place: the shared storage changes, the fused matmul sees it
    assert torch.allclose(fused_linear(x, linears)[1], k(x), atol=1e-6)
    k.weight = torch.nn.Parameter(k.weight * 3.0)  # replaced: the set no longer shares a storage
    outputs = fused_linear(x, linears)
    assert torch.allclose(outputs[1], k(x), atol=1e-6)
    assert _matmuls(lambda: fused_linear(x, linears)) == 4


@torch.no_grad()
def test_module_hooks_run_instead_of_the_fused_matmul():
    linears = _linears()
    fuse_linears(linears)
    linears[1].register_forward_hook(lambda module, args, out: out * 0)
    assert torch.equal(fused_linear(torch.randn(5, 8), linears)[1], torch.zeros(5, 8))


def test_fused_linear_refuses_anything_but_a_plain_linear():
    class LoraLinear(torch.nn.Linear):
        pass

    x = torch.randn(2, 8)
    for wrapped in (LoraLinear(8, 8), torch.nn.Sequential(torch.nn.Linear(8, 8))):
        with pytest.raises(TypeError, match="plain torch.nn.Linear"):
            fused_linear(x, (torch.nn.Linear(8, 8), wrapped))
        with pytest.raises(TypeError, match="fuse_lora"):
            fuse_linears((torch.nn.Linear(8, 8), wrapped))


def test_sets_that_cannot_share_a_storage_stay_separate():
    with_bias, without = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8, bias=False)
    assert not fuse_linears((with_bias, without))
    assert not fuse_linears((torch.nn.Linear(8, 8), torch.nn.Linear(8, 8).double()))
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(fused_linear(x, (with_bias, without))[1], without(x))


# ----- Flux ---------------------------------------------------------------------------------------
def _flux() -> FluxTransformer2DModel:
    torch.manual_seed(0)
    return FluxTransformer2DModel(**CONFIGS[("flux-fill", "tiny")]["transformer"]).eval()


def _flux_inputs(model, rows: int = 1) -> dict:
    config = model.config
    rows_ids = torch.arange(GRID[0]).repeat_interleave(GRID[1])
    cols_ids = torch.arange(GRID[1]).repeat(GRID[0])
    return dict(
        hidden_states=torch.randn(rows, GRID[0] * GRID[1], config.in_channels),
        encoder_hidden_states=torch.randn(rows, TEXT_TOKENS, config.joint_attention_dim),
        pooled_projections=torch.randn(rows, config.pooled_projection_dim),
        timestep=torch.full((rows,), 0.5),
        img_ids=torch.stack([torch.zeros_like(rows_ids), rows_ids, cols_ids], 1).float(),
        txt_ids=torch.zeros(TEXT_TOKENS, 3),
        guidance=torch.full((rows,), 3.5),
    )


def _dense_context(num_units: int, rows: int = 1) -> ForwardContext:
    return ForwardContext([None] * rows, [False] * num_units, "kv")


@torch.no_grad()
def test_flux_install_keeps_one_copy_and_the_ordinary_output():
    model = _flux()
    inputs = _flux_inputs(model)
    expected = model(**inputs).sample
    names, bytes_before = list(model.state_dict()), _unique_storage_bytes(model)
    info = install_flux_hooks(model)
    install_flux_hooks(model)  # idempotent
    assert list(model.state_dict()) == names
    assert _unique_storage_bytes(model) == bytes_before
    double, single = model.transformer_blocks[0], model.single_transformer_blocks[0]
    for first, last in ((double.attn.to_q, double.attn.to_v), (single.attn.to_q, single.proj_mlp)):
        assert first.weight.untyped_storage().data_ptr() == last.weight.untyped_storage().data_ptr()
    assert torch.allclose(model(**inputs).sample, expected, atol=1e-5)  # stock forward, views
    with active_context(_dense_context(info.num_units)):
        masked_aware = model(**inputs).sample
    assert torch.allclose(masked_aware, expected, atol=1e-4)


@pytest.mark.parametrize(
    ("argument", "value", "named"),
    [
        ("controlnet_block_samples", [torch.zeros(1, 16, 32)], "ControlNet"),
        ("controlnet_single_block_samples", [torch.zeros(1, 16, 32)], "ControlNet"),
        ("joint_attention_kwargs", {"scale": 0.5}, "fuse_lora"),
        ("joint_attention_kwargs", {"ip_adapter_image_embeds": [torch.zeros(1)]}, "IP-Adapter"),
    ],
)
@torch.no_grad()
def test_flux_forward_refuses_arguments_it_does_not_implement(argument, value, named):
    model = _flux()
    info = install_flux_hooks(model)
    inputs = _flux_inputs(model)
    with active_context(_dense_context(info.num_units)):
        with pytest.raises(UnsupportedForwardError, match=argument) as refused:
            model(**inputs, **{argument: value})
    assert named in str(refused.value)
    with active_context(_dense_context(info.num_units)):  # inert values are what stock ignores
        model(**inputs, **{argument: None})


@torch.no_grad()
def test_flux_forward_refuses_ids_off_the_row_major_grid_and_wrong_row_counts():
    model = _flux()
    info = install_flux_hooks(model)
    inputs = _flux_inputs(model)
    shuffled = dict(inputs, img_ids=inputs["img_ids"].flip(0))
    batched_ids = dict(inputs, img_ids=inputs["img_ids"][None])
    with active_context(_dense_context(info.num_units)):
        with pytest.raises(UnsupportedForwardError, match="row-major"):
            model(**shuffled)
        with pytest.raises(UnsupportedForwardError, match="2-D img_ids"):
            model(**batched_ids)
    with active_context(_dense_context(info.num_units, rows=2)):
        with pytest.raises(ValueError, match="1 rows but the forward context has 2"):
            model(**inputs)


def test_flux_install_refuses_other_processors_and_layers():
    class OtherProcessor(FluxAttnProcessor):
        pass

    model = _flux()
    model.transformer_blocks[1].attn.set_processor(OtherProcessor())
    with pytest.raises(UnsupportedModelError, match="OtherProcessor"):
        install_flux_hooks(model)
    model = _flux()
    model.single_transformer_blocks[0].attn.norm_k = torch.nn.LayerNorm(16)
    with pytest.raises(UnsupportedModelError, match=r"single_transformer_blocks\[0\].attn.norm_k"):
        install_flux_hooks(model)


@torch.no_grad()
def test_flux_forward_refuses_a_processor_swapped_after_install():
    class OtherProcessor(FluxAttnProcessor):
        pass

    model = _flux()
    info = install_flux_hooks(model)
    model.single_transformer_blocks[1].attn.set_processor(OtherProcessor())
    with active_context(_dense_context(info.num_units)):
        with pytest.raises(UnsupportedModelError, match="OtherProcessor"):
            model(**_flux_inputs(model))
    model(**_flux_inputs(model))  # no context: the stock forward runs the new processor


# ----- UNet ---------------------------------------------------------------------------------------
def _unet() -> UNet2DConditionModel:
    torch.manual_seed(0)
    return UNet2DConditionModel(**CONFIGS[("sd2-inpaint", "tiny")]["unet"]).eval()


def _stack_inputs(stack) -> tuple[torch.Tensor, torch.Tensor]:
    channels = stack.config.in_channels
    return torch.randn(1, channels, 4, 4), torch.randn(1, 5, stack.config.cross_attention_dim)


@torch.no_grad()
def test_unet_install_keeps_one_copy():
    unet = _unet()
    names, bytes_before = list(unet.state_dict()), _unique_storage_bytes(unet)
    install_unet_hooks(unet)
    assert list(unet.state_dict()) == names and _unique_storage_bytes(unet) == bytes_before
    block = unet_stacks(unet)[0].transformer_blocks[0]
    assert (
        block.attn1.to_v.weight.data_ptr()
        == block.attn1.to_q.weight.data_ptr()
        + (block.attn1.to_q.weight.numel() + block.attn1.to_k.weight.numel())
        * block.attn1.to_q.weight.element_size()
    )


@pytest.mark.parametrize(
    ("argument", "value", "named"),
    [
        ("attention_mask", torch.ones(1, 16), "attention masks"),
        ("encoder_attention_mask", torch.ones(1, 5), "attention masks"),
        ("cross_attention_kwargs", {"scale": 0.5}, "fuse_lora"),
    ],
)
@torch.no_grad()
def test_unet_stack_refuses_arguments_it_does_not_implement(argument, value, named):
    unet = _unet()
    infos = install_unet_hooks(unet)
    stack = unet_stacks(unet)[0]
    hidden, text = _stack_inputs(stack)
    num_units = sum(info.num_units for info in infos)
    with active_context(_dense_context(num_units)):
        with pytest.raises(UnsupportedForwardError, match=argument) as refused:
            stack(hidden, text, **{argument: value})
        with pytest.raises(UnsupportedForwardError, match="encoder_hidden_states"):
            stack(hidden)
        stack(hidden, text, **{argument: None})
    assert named in str(refused.value)


def test_unet_install_refuses_other_processors():
    unet = _unet()
    unet_stacks(unet)[0].transformer_blocks[0].attn2.set_processor(AttnProcessor())
    with pytest.raises(UnsupportedModelError, match="AttnProcessor"):
        install_unet_hooks(unet)

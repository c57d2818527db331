"""Reading users' adapter files through diffusers, and the normalized format.

Adapters are made with PEFT on the tiny models (tests/adapter_factory.py); what ``read_adapter``
gives must equal PEFT's own weights and scaling pair by pair, in both layouts, and what
``pipe.load_lora_weights`` loads."""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend.adapters.family import UNET, adapter_family, other_family
from backend.adapters.files import (
    AdapterFileError,
    NormalizedMeta,
    check_for_model,
    load_normalized,
    normalized_meta,
    read_for_model,
    save_normalized,
)
from backend.models import resolve_model
from backend.models.builders import build_pipeline
from tests.adapter_factory import DENOISER, default_targets, make_adapter_file, peft_pairs

pytestmark = pytest.mark.model

CASES = [
    ("tiny-sd2-inpaint", "peft"),
    ("tiny-sd2-inpaint", "kohya"),
    ("tiny-sdxl-inpaint", "peft"),
    ("tiny-sdxl-inpaint", "kohya"),
    ("tiny-flux-fill", "peft"),
]


def assert_equals_peft(adapter, reference) -> None:
    assert set(adapter.pairs) == set(reference)
    for module, (down, up, scale) in reference.items():
        pair = adapter.pairs[module]
        assert torch.equal(pair.down, down) and torch.equal(pair.up, up), module
        assert pair.scale == scale, module


@pytest.mark.parametrize(("model_id", "layout"), CASES)
def test_reading_either_layout_gives_peft_weights_and_scale(tmp_path, model_id, layout):
    path = make_adapter_file(
        model_id, tmp_path / "a.safetensors", seed=3, rank=4, alpha=6.0, layout=layout
    )
    read = read_for_model(path, model_id, max_rank=128)
    assert read.source_layout == layout
    reference = peft_pairs(model_id, seed=3, rank=4, alpha=6.0)
    assert_equals_peft(read.adapter, reference)
    assert {pair.scale for pair in read.adapter.pairs.values()} == {1.5}  # alpha / rank


def test_bytes_read_like_the_file(tmp_path):
    path = make_adapter_file("tiny-sd2-inpaint", tmp_path / "a.safetensors", rank=2)
    read = read_for_model(path.read_bytes(), "tiny-sd2-inpaint", max_rank=128)
    assert_equals_peft(read.adapter, peft_pairs("tiny-sd2-inpaint", rank=2))


@pytest.mark.parametrize(("model_id", "layout"), [CASES[1], CASES[4]])
def test_what_is_read_is_what_load_lora_weights_loads(tmp_path, model_id, layout):
    """diffusers + PEFT's own loading of the same file: same matrices, same scaling per layer."""
    targets = default_targets(model_id)[:5]
    path = make_adapter_file(
        model_id,
        tmp_path / "a.safetensors",
        seed=5,
        rank=3,
        alpha=2.0,
        targets=targets,
        layout=layout,
    )
    pipe = build_pipeline(resolve_model(model_id))
    pipe.load_lora_weights(str(tmp_path), weight_name=path.name, adapter_name="x")
    denoiser = getattr(pipe, DENOISER[resolve_model(model_id).family])
    loaded = {
        name: (m.lora_A["x"].weight, m.lora_B["x"].weight, m.scaling["x"])
        for name, m in denoiser.named_modules()
        if hasattr(m, "lora_A") and "x" in m.lora_A
    }
    assert_equals_peft(read_for_model(path, model_id, max_rank=128).adapter, loaded)


def test_normalized_round_trip_and_stable_bytes(tmp_path):
    path = make_adapter_file("tiny-flux-fill", tmp_path / "a.safetensors", rank=2, alpha=1.0)
    adapter = read_for_model(path, "tiny-flux-fill", max_rank=128).adapter
    meta = NormalizedMeta("flux-fill", "tiny-flux-fill", "peft")
    save_normalized(adapter, meta, tmp_path / "1.safetensors")
    save_normalized(adapter, meta, tmp_path / "2.safetensors")
    digest = [hashlib.sha256((tmp_path / f"{n}.safetensors").read_bytes()).digest() for n in (1, 2)]
    assert digest[0] == digest[1]
    assert normalized_meta(tmp_path / "1.safetensors") == meta
    loaded = load_normalized(tmp_path / "1.safetensors", "cpu", torch.float32, adapter_id="a1")
    assert loaded.adapter_id == "a1"
    assert_equals_peft(loaded, {m: (p.down, p.up, p.scale) for m, p in adapter.pairs.items()})
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp files
    half = load_normalized(tmp_path / "1.safetensors", "cpu", torch.float16)
    assert next(iter(half.pairs.values())).down.dtype == torch.float16


# ----- refusals ----------------------------------------------------------------------------------
def refusal(source, model_id="tiny-sd2-inpaint", max_rank=128) -> AdapterFileError:
    with pytest.raises(AdapterFileError) as caught:
        read_for_model(source, model_id, max_rank=max_rank)
    return caught.value


def test_not_a_safetensors_file_truncated_or_empty(tmp_path):
    assert refusal(b"GIF89a not an adapter").code == "unsupported_format"
    whole = make_adapter_file("tiny-sd2-inpaint", tmp_path / "a.safetensors").read_bytes()
    truncated = refusal(whole[: len(whole) // 2])
    assert "not a readable .safetensors" in str(truncated) and "truncated" in str(truncated)
    save_file({}, str(tmp_path / "empty.safetensors"))
    assert "holds no tensors" in str(refusal(tmp_path / "empty.safetensors"))


def _with_extra(tmp_path, extra: dict) -> str:
    path = make_adapter_file("tiny-sd2-inpaint", tmp_path / "a.safetensors", rank=2)
    tensors = load_file(str(path)) | extra
    out = tmp_path / "mixed.safetensors"
    save_file(tensors, str(out))
    return str(out)


def test_text_encoder_layers_are_refused_naming_them(tmp_path):
    layer = "text_encoder.text_model.encoder.layers.0.self_attn.q_proj"
    path = _with_extra(
        tmp_path,
        {f"{layer}.lora_A.weight": torch.ones(2, 32), f"{layer}.lora_B.weight": torch.ones(32, 2)},
    )
    message = str(refusal(path))
    assert "text-encoder" in message and layer in message and "only the denoiser" in message


def test_dora_is_refused(tmp_path):
    module = "unet.down_blocks.0.attentions.0.proj_in"
    path = _with_extra(tmp_path, {f"{module}.lora_magnitude_vector": torch.ones(32)})
    assert "DoRA" in str(refusal(path))


def test_conv_locon_layers_are_refused(tmp_path):
    stem = "lora_unet_down_blocks_0_resnets_0_conv1"
    path = tmp_path / "locon.safetensors"
    save_file(
        {
            f"{stem}.lora_down.weight": torch.ones(2, 32, 3, 3),
            f"{stem}.lora_up.weight": torch.ones(32, 2, 1, 1),
            f"{stem}.alpha": torch.tensor(2.0),
        },
        str(path),
    )
    message = str(refusal(path))
    assert "convolution (LoCon)" in message and "down_blocks.0.resnets.0.conv1" in message


def test_keys_diffusers_cannot_convert_are_refused(tmp_path):
    path = _with_extra(tmp_path, {"something_else.weight": torch.ones(3)})
    assert "diffusers could not convert" in str(refusal(path))


def test_rank_over_the_limit_is_refused(tmp_path):
    path = make_adapter_file("tiny-sd2-inpaint", tmp_path / "a.safetensors", rank=4)
    message = str(refusal(path, max_rank=2))
    assert "rank 4" in message and "limit of 2" in message


@pytest.mark.parametrize(
    ("maker", "layout", "model_id", "words"),
    [
        (
            "tiny-sd2-inpaint",
            "peft",
            "tiny-flux-fill",
            "SD 1.x/2.x (sd2-inpaint), the model is Flux",
        ),
        (
            "tiny-sd2-inpaint",
            "kohya",
            "tiny-sdxl-inpaint",
            "SD 1.x/2.x (sd2-inpaint), the model is SDXL",
        ),
        (
            "tiny-sdxl-inpaint",
            "peft",
            "tiny-sd2-inpaint",
            "SDXL (sdxl-inpaint), the model is SD 1.x/2.x",
        ),
        ("tiny-sdxl-inpaint", "kohya", "tiny-flux-fill", "SDXL (sdxl-inpaint), the model is Flux"),
        ("tiny-flux-fill", "peft", "tiny-sd2-inpaint", "Flux (flux-fill), the model is SD 1.x/2.x"),
    ],
)
def test_an_adapter_of_another_family_is_refused_naming_both(
    tmp_path, maker, layout, model_id, words
):
    path = make_adapter_file(maker, tmp_path / "a.safetensors", rank=2, layout=layout)
    assert f"this adapter is for {words}" in str(refusal(path, model_id))


def test_the_family_is_told_from_the_names_of_every_layout():
    """Names as the diffusers/PEFT, the older diffusers, kohya and kohya's SGM layouts write them
    for the published architectures; a UNet adapter that leaves attention alone is a UNet, and
    names of no denoiser say nothing."""
    cases = {
        "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_A": "sd2-inpaint",
        "unet.down_blocks.0.attentions.1.proj_in.lora.down.weight": "sd2-inpaint",
        "lora_unet_input_blocks_1_1_proj_in.lora_down.weight": "sd2-inpaint",
        "unet.up_blocks.0.attentions.2.transformer_blocks.9.attn2.to_k.lora_B": "sdxl-inpaint",
        "lora_unet_output_blocks_0_1_transformer_blocks_0_attn1_to_q.lora_up": "sdxl-inpaint",
        "transformer.transformer_blocks.3.attn.to_q.lora_A.weight": "flux-fill",
        "transformer.single_transformer_blocks.7.proj_out.lora_B.weight": "flux-fill",
        "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": "flux-fill",
        "lora_unet_single_blocks_3_linear1.lora_down.weight": "flux-fill",
        "unet.mid_block.resnets.0.time_emb_proj.lora_A.weight": UNET,
        "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": None,
    }
    for key, family in cases.items():
        assert adapter_family([key]) == family, key
    assert (
        other_family(["unet.mid_block.resnets.0.time_emb_proj.lora_A.weight"], "sdxl-inpaint")
        is None
    )


def test_an_adapter_of_another_shape_names_the_layer_and_model(tmp_path):
    sd2 = make_adapter_file("tiny-sd2-inpaint", tmp_path / "sd2.safetensors", rank=2)
    other = str(refusal(sd2, "small-sd2-inpaint"))
    assert "small-sd2-inpaint" in other and "down_blocks.0.attentions.0" in other
    assert "another model" in other
    sdxl = read_for_model(
        make_adapter_file("tiny-sdxl-inpaint", tmp_path / "x.safetensors", rank=2),
        "tiny-sdxl-inpaint",
        max_rank=8,
    )
    with pytest.raises(AdapterFileError, match="tiny-sd2-inpaint"):
        check_for_model(sdxl.adapter, "tiny-sd2-inpaint")

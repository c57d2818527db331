"""Architecture configs of every built form (tiny, small, arch) of the three families.

``tiny`` is for tests and the default demo (a 20-step 256 px edit in well under a second on a CPU),
``small`` is where transformer compute dominates on a CPU (benchmarks here), ``arch`` is the
published full-size architecture (random weights; GPU benchmarks). Each entry maps a component name
to the keyword arguments of its diffusers/transformers class.
"""

from __future__ import annotations

from backend.models.tokenizers import clip_vocab_size, t5_vocab_size

BUILDER_VERSION = 3  # bump whenever building changes the weights of an unchanged config
# arch forms keep the published embedding tables (ids past ours stay unused)
CLIP_VOCAB_PUBLISHED = 49408
T5_VOCAB_PUBLISHED = 32128


def _vae(latent_channels: int, width: int, flux: bool) -> dict:
    # Four levels downsample by 8; no mid-block attention (it is slow at 256+ px on a CPU).
    config = dict(
        block_out_channels=(width,) * 4,
        in_channels=3,
        out_channels=3,
        latent_channels=latent_channels,
        norm_num_groups=min(8, width),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        mid_block_add_attention=False,
        layers_per_block=1,
        force_upcast=False,
    )  # float32-safe; avoids a per-call `vae.to(float32)` in the SDXL pipeline
    if flux:
        config.update(
            scaling_factor=0.3611,
            shift_factor=0.1159,
            use_quant_conv=False,
            use_post_quant_conv=False,
        )
    return config


def _clip(
    hidden: int, layers: int, heads: int, projection: int | None = None, vocab: int | None = None
) -> dict:
    # bos/eos are our tokenizer's ids: CLIP pools the hidden state at the eos position.
    config = dict(
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        vocab_size=vocab or clip_vocab_size(),
        max_position_embeddings=77,
        bos_token_id=clip_vocab_size() - 2,
        eos_token_id=clip_vocab_size() - 1,
        pad_token_id=clip_vocab_size() - 1,
        hidden_act="quick_gelu",
    )
    if projection is not None:
        config["projection_dim"] = projection
    return config


def _t5(d_model: int, layers: int, heads: int, d_ff: int, vocab: int | None = None) -> dict:
    return dict(
        vocab_size=vocab or t5_vocab_size(),
        d_model=d_model,
        d_kv=d_model // heads,
        d_ff=d_ff,
        num_layers=layers,
        num_heads=heads,
        feed_forward_proj="gated-gelu",
        is_encoder_decoder=False,
    )


def _arch_vae(latent_channels: int, flux: bool, scaling_factor: float | None = None) -> dict:
    """The published SD/SDXL/Flux autoencoder shape (with its mid-block attention)."""
    config = dict(
        _vae(latent_channels, 128, flux),
        block_out_channels=(128, 256, 512, 512),
        norm_num_groups=32,
        layers_per_block=2,
        mid_block_add_attention=True,
        sample_size=1024 if flux else 512,
        force_upcast=True,
    )
    if scaling_factor is not None:
        config["scaling_factor"] = scaling_factor
    return config


def _sd2_unet(channels, heads, cross_dim: int, layers: int = 2) -> dict:
    levels = len(channels)
    return dict(
        block_out_channels=channels,
        layers_per_block=layers,
        in_channels=9,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D",) * (levels - 1) + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (levels - 1),
        cross_attention_dim=cross_dim,
        attention_head_dim=heads,
        use_linear_projection=True,
        norm_num_groups=min(32, channels[0]),
        sample_size=64,
    )


def _sdxl_unet(
    channels, heads, depths, cross_dim: int, time_dim: int, pooled_dim: int, layers: int = 2
) -> dict:
    return dict(
        block_out_channels=channels,
        layers_per_block=layers,
        in_channels=9,
        out_channels=4,
        down_block_types=("DownBlock2D",) + ("CrossAttnDownBlock2D",) * (len(channels) - 1),
        up_block_types=("CrossAttnUpBlock2D",) * (len(channels) - 1) + ("UpBlock2D",),
        transformer_layers_per_block=depths,
        cross_attention_dim=cross_dim,
        attention_head_dim=heads,
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=time_dim,
        projection_class_embeddings_input_dim=pooled_dim + 6 * time_dim,
        norm_num_groups=min(32, channels[0]),
        sample_size=128,
    )


def _flux(
    heads: int, head_dim: int, double: int, single: int, text_dim: int, pooled_dim: int, rope
) -> dict:
    return dict(
        patch_size=1,
        in_channels=384,
        out_channels=64,
        num_layers=double,
        num_single_layers=single,
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=text_dim,
        pooled_projection_dim=pooled_dim,
        axes_dims_rope=rope,
        guidance_embeds=True,
    )


CONFIGS: dict[tuple[str, str], dict[str, dict]] = {
    ("sd2-inpaint", "tiny"): dict(
        unet=_sd2_unet((32, 64), (2, 4), 32, layers=1),
        vae=_vae(4, 8, False),
        text_encoder=_clip(32, 2, 4),
    ),
    ("sd2-inpaint", "small"): dict(
        unet=_sd2_unet((64, 128, 256, 256), (1, 2, 4, 4), 64),
        vae=_vae(4, 8, False),
        text_encoder=_clip(64, 2, 4),
    ),
    ("sd2-inpaint", "arch"): dict(
        unet=_sd2_unet((320, 640, 1280, 1280), (5, 10, 20, 20), 1024),
        vae=_arch_vae(4, False, 0.18215),  # OpenCLIP-H/14 text tower:
        text_encoder=_clip(1024, 23, 16, projection=512, vocab=CLIP_VOCAB_PUBLISHED)
        | dict(hidden_act="gelu"),
    ),
    ("sdxl-inpaint", "tiny"): dict(
        unet=_sdxl_unet((32, 64), (2, 4), (1, 2), 64, 8, 32, layers=1),
        vae=_vae(4, 8, False),
        text_encoder=_clip(32, 2, 4),
        text_encoder_2=_clip(32, 2, 4, projection=32),
    ),
    # SDXL proportions (no attention at the top level, depth 2 then 10, widest at the bottom): at
    # 512 px convolutions are 18% of the FLOPs, as the transformer blocks dominate real SDXL.
    ("sdxl-inpaint", "small"): dict(
        unet=_sdxl_unet((32, 64, 256), (1, 2, 4), (1, 2, 10), 128, 32, 64),
        vae=_vae(4, 8, False),
        text_encoder=_clip(64, 2, 4),
        text_encoder_2=_clip(64, 2, 4, projection=64),
    ),
    ("sdxl-inpaint", "arch"): dict(
        unet=_sdxl_unet((320, 640, 1280), (5, 10, 20), (1, 2, 10), 2048, 256, 1280),
        vae=_arch_vae(4, False, 0.13025),  # CLIP-L/14 and OpenCLIP-bigG/14:
        text_encoder=_clip(768, 12, 12, projection=768, vocab=CLIP_VOCAB_PUBLISHED),
        text_encoder_2=_clip(1280, 32, 20, projection=1280, vocab=CLIP_VOCAB_PUBLISHED)
        | dict(hidden_act="gelu"),
    ),
    ("flux-fill", "tiny"): dict(
        transformer=_flux(2, 16, 2, 2, 32, 32, (4, 6, 6)),
        vae=_vae(16, 8, True),
        text_encoder=_clip(32, 2, 4),
        text_encoder_2=_t5(32, 2, 4, 64),
    ),
    ("flux-fill", "small"): dict(
        transformer=_flux(8, 64, 4, 8, 64, 64, (16, 24, 24)),
        vae=_vae(16, 8, True),
        text_encoder=_clip(64, 2, 4),
        text_encoder_2=_t5(64, 2, 4, 128),
    ),
    ("flux-fill", "arch"): dict(
        transformer=_flux(24, 128, 19, 38, 4096, 768, (16, 56, 56)),
        vae=_arch_vae(16, True),  # CLIP-L/14 and T5-XXL (v1.1) encoder:
        text_encoder=_clip(768, 12, 12, projection=768, vocab=CLIP_VOCAB_PUBLISHED),
        text_encoder_2=_t5(4096, 24, 64, 10240, vocab=T5_VOCAB_PUBLISHED),
    ),
}

# Scheduler keyword arguments per family (part of a built model's revision: they change its
# outputs). UNets: SD betas with Euler steps (no noise inside a step); Flux: the published dynamic
# shifting.
SCHEDULERS: dict[str, dict] = {
    "sd2-inpaint": dict(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        num_train_timesteps=1000,
        steps_offset=1,
        timestep_spacing="leading",
        prediction_type="epsilon",
    ),
    "flux-fill": dict(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    ),
}
SCHEDULERS["sdxl-inpaint"] = SCHEDULERS["sd2-inpaint"]

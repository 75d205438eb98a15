"""Stage one for Wan 2.2 TI2V-5B image-to-video: its cache needs nothing of its own. The wan2.2-ti2v-5b preset, loaded
with tiny weights in the diffusers layout (a Wan 2.2-like VAE: 48 channels, 2x2 patchify, residual blocks, 16x), caches
clips whose first latent frame is exactly the image latent WanImageToVideoPipeline(expand_timesteps=True) builds from
that frame (`prepare_latents`), whatever the frames after it: stage two takes the condition from the clip's latent."""

import numpy as np
import pytest
import torch
from PIL import Image
from test_wan_precompute import clips

from precompute.encode import Encoders
from precompute.presets import get_preset, save_tiny

pytestmark = pytest.mark.model  # tiny diffusers and transformers models

CHANNELS = 48
CPU = torch.device("cpu")


def tiny_wan22_vae():
    """AutoencoderKLWan shaped as the Wan 2.2 VAE at CPU size, seeded."""
    from diffusers import AutoencoderKLWan

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoencoderKLWan(base_dim=8, decoder_base_dim=8, z_dim=CHANNELS, in_channels=12, out_channels=12,
                                is_residual=True, patch_size=2, scale_factor_spatial=16, dim_mult=[1, 2, 2, 2],
                                num_res_blocks=1, attn_scales=[], temperal_downsample=[False, True, True],
                                latents_mean=[0.02 * c - 0.5 for c in range(CHANNELS)],
                                latents_std=[0.5 + 0.02 * c for c in range(CHANNELS)])


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    """wan2.2-ti2v-5b's encoders from a directory in the diffusers layout: the tiny umT5 and tokenizer, and the tiny
    Wan 2.2-like VAE in vae/ (the published preset's path, --pretrained DIR)."""
    directory = tmp_path_factory.mktemp("tiny-ti2v")
    save_tiny(get_preset("tiny-wan"), directory)
    tiny_wan22_vae().save_pretrained(directory / "vae")
    return Encoders(get_preset("wan2.2-ti2v-5b"), CPU, pretrained=str(directory))


def test_a_ti2v_cache_holds_no_first_frame_field(encoders):
    assert encoders.first_frame_fields == ()
    assert not {"condition", "image_embeds"} & set(encoders.schema(torch.bfloat16))
    assert (encoders.latent.channels, encoders.latent.downsample, encoders.latent.temporal_downsample) == (CHANNELS, 16, 4)


def test_a_clips_first_latent_frame_is_the_pipelines_image_latent(encoders):
    """Each clip's cached first latent frame (the posterior's mean, normalised) equals `latent_condition` of
    WanImageToVideoPipeline(expand_timesteps=True).prepare_latents for the clip's first frame given as an image; its
    `first_frame_mask` keeps that frame (0) and noises the rest (1); a clip whose later frames differ has the same first
    latent frame."""
    from diffusers import WanImageToVideoPipeline

    pixels = clips(2, 17, 64, 96, seed=3)
    pipe = WanImageToVideoPipeline(tokenizer=None, text_encoder=None, vae=encoders.vae, scheduler=None, expand_timesteps=True)
    for i in range(2):
        clip = pixels[i : i + 1]
        cached = encoders.encode_videos(clip)  # one clip at a time, as the pipeline encodes one image
        assert cached["latent_mean"].shape == (1, CHANNELS, 5, 4, 6)
        image = Image.fromarray(clip[0, :, 0].permute(1, 2, 0).numpy())  # the first frame, as a user gives it
        x = pipe.video_processor.preprocess(image, height=64, width=96).to(dtype=torch.float32)
        with torch.no_grad():
            _, condition, mask = pipe.prepare_latents(x, 1, CHANNELS, 64, 96, 17, torch.float32, CPU,
                                                      generator=torch.Generator().manual_seed(0))
        assert condition.shape == (1, CHANNELS, 1, 4, 6)
        assert torch.equal(cached["latent_mean"][:, :, :1], condition)
        assert mask.shape == (1, 1, 5, 4, 6) and not mask[:, :, 0].any() and bool((mask[:, :, 1:] == 1).all())
        # the VAE is causal: other frames after the first leave its latent as it is
        other = clip.clone()
        other[:, :, 1:] = torch.from_numpy(np.random.default_rng(i).integers(0, 256, other[:, :, 1:].shape, dtype=np.uint8))
        changed = encoders.encode_videos(other)
        assert torch.equal(changed["latent_mean"][:, :, :1], condition)
        assert not torch.equal(changed["latent_mean"][:, :, 1:], cached["latent_mean"][:, :, 1:])

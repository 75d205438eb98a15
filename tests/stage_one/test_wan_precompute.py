"""Stage one for Wan (tiny-wan, tiny-wan-i2v): what the cache stores for a clip and a caption is what the stock
pipelines compute — WanPipeline's prompt embeddings (stored trimmed, rebuilt by zero-filling to the token limit), the
VAE posterior normalised per channel as WanPipeline normalises latents, and for image-to-video what
WanImageToVideoPipeline builds from the first frame (its `prepare_latents` condition and `encode_image` embedding) —
with the tiny encoders saved in the diffusers layout and loaded back as the published ones load."""

import weakref

import pytest
import torch
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from precompute.config import PrecomputeConfig
from precompute.encode import Encoders
from precompute.families import wan
from precompute.families.wan import FAMILY
from precompute.presets import get_preset, save_tiny
from shards import Bucket

pytestmark = pytest.mark.model  # tiny diffusers and transformers models

TOKENS = 64  # tiny-umt5's caption limit
LONG = "a " + " and ".join(["large red circle on a blue background"] * 12)  # over 64 tokens: cut as the pipeline cuts
CAPTIONS = ["a large red circle on a blue background", "a tiny pink star", "", LONG]
PRESETS = ["wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "wan2.1-i2v-14b-480p", "wan2.1-i2v-14b-720p", "wan2.2-t2v-a14b",
           "wan2.2-i2v-a14b", "wan2.2-ti2v-5b", "tiny-wan", "tiny-wan-i2v"]
CPU = torch.device("cpu")


def clips(batch: int, frames: int, height: int, width: int, seed: int = 0) -> torch.Tensor:
    """(B, 3, F, H, W) uint8: smooth moving gradients, so the VAE sees structure rather than noise."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(frames).view(1, 1, frames, 1, 1)
    y, x = torch.arange(height).view(1, 1, 1, height, 1), torch.arange(width).view(1, 1, 1, 1, width)
    phase = torch.rand(batch, 3, 1, 1, 1, generator=g) * 6
    return (127.5 + 127.5 * torch.sin(phase + 0.2 * x + 0.1 * y + 0.3 * t)).round().clamp(0, 255).to(torch.uint8)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """tiny-wan-i2v's VAE, umT5, tokenizer, CLIP vision encoder and image processor in the diffusers layout."""
    directory = tmp_path_factory.mktemp("tiny-wan-i2v")
    save_tiny(get_preset("tiny-wan-i2v"), directory)
    return directory


@pytest.fixture(scope="module")
def encoders(saved):
    """tiny-wan-i2v's encoders loaded back from the saved directory (the published presets' path)."""
    return Encoders(get_preset("tiny-wan-i2v"), CPU, pretrained=str(saved))


@pytest.fixture(scope="module")
def stock(saved):
    """The stock WanPipeline and WanImageToVideoPipeline with the saved components loaded by their own classes'
    `from_pretrained` (the text encoded by WanPipeline: WanImageToVideoPipeline's copy of the caption cleaning calls
    ftfy, which is not installed, and the image-to-video pipeline takes the cached embeddings)."""
    import diffusers
    from transformers import AutoTokenizer, CLIPImageProcessor, CLIPVisionModel, UMT5EncoderModel

    vae, scheduler = diffusers.AutoencoderKLWan.from_pretrained(saved / "vae").eval(), diffusers.FlowMatchEulerDiscreteScheduler()
    text = diffusers.WanPipeline(tokenizer=AutoTokenizer.from_pretrained(saved / "tokenizer"), vae=vae, scheduler=scheduler,
                                 text_encoder=UMT5EncoderModel.from_pretrained(saved / "text_encoder").eval())
    i2v = diffusers.WanImageToVideoPipeline(
        tokenizer=None, text_encoder=None, vae=vae, scheduler=scheduler, transformer=None,
        image_processor=CLIPImageProcessor.from_pretrained(saved / "image_processor"),
        image_encoder=CLIPVisionModel.from_pretrained(saved / "image_encoder").eval())
    return {"text": text, "i2v": i2v}


def test_presets_and_what_the_family_declares():
    presets = FAMILY.presets()
    assert list(presets) == PRESETS
    assert (FAMILY.name, FAMILY.video, FAMILY.frame_rate, FAMILY.temporal_downsample) == ("wan", True, 16.0, 4)
    assert FAMILY.frame_buckets == (1, 17, 33, 49, 81)
    assert {n for n, p in presets.items() if p.image_to_video} == {"wan2.1-i2v-14b-480p", "wan2.1-i2v-14b-720p",
                                                                   "wan2.2-i2v-a14b", "tiny-wan-i2v"}
    # the CLIP image embedding is Wan 2.1 I2V's alone; Wan 2.2 I2V A14B has no image encoder
    assert {n for n, p in presets.items() if p.image_encoder} == {"wan2.1-i2v-14b-480p", "wan2.1-i2v-14b-720p", "tiny-wan-i2v"}
    assert FAMILY.first_frame_fields(presets["wan2.2-i2v-a14b"]) == ("condition",)
    assert FAMILY.first_frame_fields(presets["wan2.1-i2v-14b-720p"]) == ("condition", "image_embeds")
    assert FAMILY.first_frame_fields(presets["wan2.1-t2v-14b"]) == ()
    assert {n: p.base_resolution for n, p in presets.items() if p.base_resolution != 480} == {
        "wan2.1-i2v-14b-720p": 720, "wan2.2-ti2v-5b": 720, "tiny-wan": 64, "tiny-wan-i2v": 64}
    assert all(p.text.max_length == 512 and p.text.repo == p.vae.repo == p.transformer for n, p in presets.items()
               if not n.startswith("tiny"))
    ti2v = presets["wan2.2-ti2v-5b"]
    assert (ti2v.vae.kind, ti2v.granularity, FAMILY.frame_rate_of(ti2v)) == ("wan2.2", 32, 24.0)
    assert FAMILY.frame_rate_of(presets["tiny-wan"]) == 16.0


def test_bucket_tables_of_480p_and_720p():
    for name, resolution, size in (("wan2.1-t2v-1.3b", 480, (480, 832)), ("wan2.1-i2v-14b-720p", 720, (720, 1280)),
                                   ("wan2.2-ti2v-5b", 720, (704, 1280)), ("wan2.2-ti2v-5b", 480, (480, 832))):
        preset = get_preset(name)
        table = FAMILY.bucket_table(preset, resolution)
        assert len(table) == 33 and len(set(table)) == 33  # one bucket per aspect ratio of the 1024 table
        assert all(b.frames == 0 and b.height % preset.granularity == 0 and b.width % preset.granularity == 0 for b in table)
        assert Bucket(*size) in table and Bucket(size[1], size[0]) in table  # the sizes the models generate at
        assert [b.aspect for b in table] == sorted(b.aspect for b in table)
        area = (720 * 1280) if resolution == 720 else (480 * 832)
        assert all(abs(b.pixels / area - 1) < 0.12 for b in table if 0.5 <= b.aspect <= 2)
        assert all(b.pixels <= wan.TILE_ABOVE_PIXELS for b in table)  # encoded whole, as the pipelines encode
    assert any(b.pixels > wan.TILE_ABOVE_PIXELS for b in FAMILY.bucket_table(get_preset("wan2.1-t2v-14b"), 1024))
    # the 480p and 720p tables through the run's options, and the resolutions the family takes
    config = PrecomputeConfig("data", "wan2.1-t2v-1.3b", resolution="480,720")
    assert config.table(480) == FAMILY.bucket_table(get_preset("wan2.1-t2v-1.3b"), 480)
    assert Bucket(720, 1280) in config.table(720)
    assert Bucket(64, 64) in PrecomputeConfig("data", "tiny-wan").table(64)
    for bad in ("500", "32", "1040"):
        with pytest.raises(ValueError, match=rf"--resolution {bad}: {bad} is neither 480 nor 720 .* nor a multiple of 16 "
                                             r"from 64 to 1024"):
            PrecomputeConfig("data", "wan2.1-t2v-1.3b", resolution=bad)
    # TI2V-5B's 32-px tokens: 720 (its 720p table) and 480 all the same, other sides multiples of 32
    ti2v = PrecomputeConfig("data", "wan2.2-ti2v-5b", resolution="480,720,512")
    assert ti2v.resolutions() == (480, 720, 512) and Bucket(704, 1280) in ti2v.table(720)
    with pytest.raises(ValueError, match="--resolution 496: 496 is neither 480 nor 720 .* nor a multiple of 32"):
        PrecomputeConfig("data", "wan2.2-ti2v-5b", resolution="496")
    with pytest.raises(ValueError, match="--resolution 480: 480 is not a multiple of 64"):
        PrecomputeConfig("data", "tiny-sana", resolution="480")  # image families keep their rule


def test_parameter_counts_of_the_published_encoders():
    """The Wan 2.1 VAE (AutoencoderKLWan's defaults), the Wan 2.2 VAE (its published config), umT5-XXL and the CLIP
    ViT-H/14 vision tower, built on the meta device."""
    from diffusers import AutoencoderKLWan
    from transformers import CLIPVisionConfig, CLIPVisionModel, UMT5Config, UMT5EncoderModel

    def count(module):
        return sum(p.numel() for p in module.parameters())

    with torch.device("meta"):
        wan21, wan22 = AutoencoderKLWan(), AutoencoderKLWan(**wan.WAN22_VAE)
        umt5 = UMT5EncoderModel(UMT5Config(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
                                           feed_forward_proj="gated-gelu", is_encoder_decoder=False))
        clip = CLIPVisionModel(CLIPVisionConfig(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                                                num_attention_heads=16, image_size=224, patch_size=14, hidden_act="gelu"))
    assert count(wan21) == 126_892_531 and count(wan22) == 704_688_668
    assert (wan21.config.scale_factor_spatial, wan22.config.scale_factor_spatial, wan22.config.z_dim) == (8, 16, 48)
    assert count(umt5) == 5_680_910_336  # "umT5-XXL, 5.7 B parameters"
    assert count(clip) == 630_766_080
    assert clip.embeddings.num_positions == 257  # the 257 tokens of the I2V image embedding


def test_the_tiny_encoders_save_and_load_back_as_published_ones_load(saved, encoders):
    seeded = Encoders(get_preset("tiny-wan-i2v"), CPU)
    built, loaded = seeded.fingerprint(), encoders.fingerprint()
    for part in (built, loaded):
        for key in ("vae", "text_encoder"):
            part[key].pop("source")
        part["first_frame"]["image_encoder"].pop("source")
    assert built == loaded
    assert sorted(p.name for p in saved.iterdir()) == ["image_encoder", "image_processor", "text_encoder", "tokenizer", "vae"]
    assert encoders.fingerprint()["vae"]["source"] == str(saved)
    # a tiny-wan (text to video) cache has no first-frame part and no first-frame fields
    t2v = Encoders(get_preset("tiny-wan"), CPU)
    assert "first_frame" not in t2v.fingerprint() and not {"condition", "image_embeds"} & set(t2v.schema(torch.bfloat16))
    assert {"condition", "image_embeds"} <= set(encoders.schema(torch.bfloat16))
    assert t2v.fingerprint()["vae"]["temporal_downsample"] == 4


def test_cached_text_rebuilds_the_pipelines_prompt_embeddings(saved, encoders, stock):
    """Each caption's stored valid tokens, zero-filled to the limit, are exactly WanPipeline.encode_prompt's
    embeddings of the batch (one cut at the limit, the empty caption too)."""
    t2v = Encoders(get_preset("tiny-wan"), CPU, pretrained=str(saved), vae=False)  # the same umT5, 64 tokens
    batch = t2v.encode_text(CAPTIONS)
    with torch.no_grad():
        embeds, _ = stock["text"].encode_prompt(CAPTIONS, do_classifier_free_guidance=False, max_sequence_length=TOKENS, device="cpu")
    assert embeds.shape == (4, TOKENS, 32)
    rebuilt = torch.stack([torch.cat([f["text"], f["text"].new_zeros(TOKENS - len(f["text"]), 32)]) for f in batch.fields])
    assert torch.equal(rebuilt, embeds)
    assert [len(f["text"]) for f in batch.fields] == [9, 5, 1, TOKENS]  # words + end of sequence; the empty one: EOS
    assert batch.truncated == [False, False, False, True]
    spec = t2v.text_spec()
    assert (spec.layout, spec.width, spec.max_tokens) == ("padded", 32, TOKENS)
    # the image-to-video transformer takes exactly 512 text tokens: tiny-wan-i2v's captions fill to 512
    assert (encoders.text_spec().layout, encoders.text_spec().max_tokens) == ("padded", 512)
    fields = encoders.encode_text(CAPTIONS[:2]).fields
    with torch.no_grad():
        embeds, _ = stock["text"].encode_prompt(CAPTIONS[:2], do_classifier_free_guidance=False, max_sequence_length=512,
                                                 device="cpu")
    assert embeds.shape == (2, 512, 32) and all(torch.equal(f["text"], e[: len(f["text"])]) for f, e in zip(fields, embeds))
    assert not embeds[0, 9:].any() and not embeds[1, 5:].any()


def test_cached_latents_are_the_pipelines_normalised_posterior(encoders, stock):
    pixels = clips(2, 17, 64, 96)
    out = encoders.encode_videos(pixels)
    assert out["latent_mean"].shape == out["latent_std"].shape == (2, 16, 5, 8, 12)  # (B, C, (F - 1) // 4 + 1, h, w)
    # the pipeline's pixels: its video processor's [-1, 1] of the frames, bit for bit
    frames = [Image.fromarray(f.permute(1, 2, 0).numpy()) for f in pixels[0].unbind(1)]
    assert torch.equal(stock["text"].video_processor.preprocess(frames, height=64, width=96).permute(1, 0, 2, 3),
                       2.0 * (pixels[0].float() / 255.0) - 1.0)
    vae = stock["text"].vae
    with torch.no_grad():
        dist = vae.encode(2.0 * (pixels.float() / 255.0) - 1.0).latent_dist
    mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
    inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
    assert torch.equal(out["latent_mean"], (dist.mean - mean) * inverse_std)  # WanPipeline's own expression
    assert torch.equal(out["latent_std"], dist.std * inverse_std)
    # an image is a one-frame clip
    with torch.no_grad():
        one = FAMILY.encode_images(encoders.vae, 2.0 * (pixels[:, :, 0].float() / 255.0) - 1.0, encoders.latent)
    single = encoders.encode_videos(pixels[:, :, :1])
    assert one["latent_mean"].shape == (2, 16, 1, 8, 12) and torch.equal(one["latent_mean"], single["latent_mean"])


def test_the_vae_is_causal_a_clips_first_latent_frames_are_its_first_frames_latents(encoders):
    """The first latent frame depends on the first pixel frame alone, and the first k + 1 on the first 4k + 1: the
    first-frame latent TI2V-5B conditions on (WanImageToVideoPipeline with expand_timesteps) is the cached clip's first
    latent frame, so its cache needs no field of its own (and a clip's cached latents hold those of its shorter heads)."""
    from diffusers import WanImageToVideoPipeline

    pixels = clips(2, 17, 64, 64, seed=3)
    whole = encoders.encode_videos(pixels)
    for frames, latent_frames in ((1, 1), (9, 3)):
        head = encoders.encode_videos(pixels[:, :, :frames])
        assert torch.equal(whole["latent_mean"][:, :, :latent_frames], head["latent_mean"])
        assert torch.equal(whole["latent_std"][:, :, :latent_frames], head["latent_std"])
    # TI2V's image conditioning as WanImageToVideoPipeline builds it with expand_timesteps (its second value)
    ti2v = WanImageToVideoPipeline(tokenizer=None, text_encoder=None, vae=encoders.vae, scheduler=None, expand_timesteps=True)
    for i in range(2):
        image = 2.0 * (pixels[i : i + 1, :, 0].float() / 255.0) - 1.0
        with torch.no_grad():
            _, condition, _ = ti2v.prepare_latents(image, 1, 16, 64, 64, 17, torch.float32, CPU,
                                                   generator=torch.Generator().manual_seed(0))
        alone = encoders.encode_videos(pixels[i : i + 1])  # batched alike: a batch of 2 moves the last bits
        assert torch.equal(condition, alone["latent_mean"][:, :, :1])


def test_the_first_frame_fields_are_what_the_image_to_video_pipeline_builds(encoders, stock):
    pixels, stock = clips(2, 9, 64, 96, seed=1), stock["i2v"]
    out = encoders.encode_videos(pixels)
    assert out["condition"].shape == (2, 4 + 16, 3, 8, 12) and out["image_embeds"].shape == (2, 17, 32)
    for i in range(2):
        image = Image.fromarray(pixels[i, :, 0].permute(1, 2, 0).numpy())  # the first frame, as a user gives it
        with torch.no_grad():
            x = stock.video_processor.preprocess(image, height=64, width=96).to(dtype=torch.float32)
            _, condition = stock.prepare_latents(x, 1, 16, 64, 96, 9, torch.float32, CPU,
                                                 generator=torch.Generator().manual_seed(0))
            embeds = stock.encode_image(image, CPU)
        assert torch.equal(out["condition"][i : i + 1], condition)
        assert torch.equal(out["image_embeds"][i : i + 1], embeds)
    mask = out["condition"][:, :4]
    assert torch.equal(mask[:, :, 0], torch.ones_like(mask[:, :, 0])) and not mask[:, :, 1:].any()  # the first frame only
    # Wan 2.2 I2V A14B's fields: the condition alone (its transformer takes no image embedding)
    a14b = FAMILY.presets()["wan2.2-i2v-a14b"]
    side = FAMILY.load_first_frame(a14b, encoders.vae, None, torch.float32)
    x = 2.0 * (pixels.float() / 255.0) - 1.0
    with torch.inference_mode():
        fields = FAMILY.encode_first_frames(side, x, pixels[:, :, 0], encoders.latent)
    assert list(fields) == ["condition"] and torch.equal(fields["condition"], out["condition"])


def test_large_frames_are_encoded_in_tiles(encoders, monkeypatch):
    """Above the threshold the VAE's tiled encoder runs (space is bounded; time is chunked by the VAE already), and
    its latents are close to the whole frame's; at or below it the clip is encoded whole."""
    vae = encoders.vae
    pixels = clips(1, 5, 64, 96, seed=2)
    whole = encoders.encode_videos(pixels)
    assert not vae.use_tiling
    calls = []
    original = type(vae).tiled_encode
    monkeypatch.setattr(type(vae), "tiled_encode", lambda self, x: calls.append(x.shape) or original(self, x))
    monkeypatch.setattr(wan, "TILE_ABOVE_PIXELS", 64 * 64)
    monkeypatch.setattr(vae, "tile_sample_min_height", 48)
    monkeypatch.setattr(vae, "tile_sample_min_width", 48)
    monkeypatch.setattr(vae, "tile_sample_stride_height", 32)
    monkeypatch.setattr(vae, "tile_sample_stride_width", 32)
    tiled = encoders.encode_videos(pixels)
    assert vae.use_tiling and calls == [(1, 3, 5, 64, 96)] * 2  # the latents, and the first frame's condition
    for name in ("latent_mean", "condition"):
        error = (tiled[name] - whole[name]).abs().mean() / whole[name].abs().mean()
        assert tiled[name].shape == whole[name].shape and error < 0.2
    vae.disable_tiling()


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes of tensors alive at once over the ops run inside it (a storage counts from the op that
    creates it until its last tensor is gone), the inputs and weights left out: what a GPU's allocator holds."""

    def __init__(self):
        super().__init__()
        self.alive, self.bytes, self.peak = {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                key = tensor.untyped_storage()._cdata
                if key not in self.alive:
                    self.alive[key] = [tensor.untyped_storage().nbytes(), 0]
                    self.bytes += self.alive[key][0]
                    self.peak = max(self.peak, self.bytes)
                self.alive[key][1] += 1
                weakref.finalize(tensor, self.release, key).atexit = False
        return out

    def release(self, key):
        self.alive[key][1] -= 1
        if not self.alive[key][1]:
            self.bytes -= self.alive.pop(key)[0]


def test_a_720p_clip_of_81_frames_encodes_whole_beside_umt5_on_a_24_gb_card():
    """The published Wan 2.1 VAE's encoder traced on the meta device: a 720 x 1280 clip of 81 frames needs no more
    than one of 17 (the causal chunks), and in bf16 (the default on CUDA) fits a 24 GB card's 22 GiB beside umT5-XXL
    in bf16; in fp32 it would not."""
    from diffusers import AutoencoderKLWan

    GiB = 2**30

    def peak(frames: int, dtype: torch.dtype) -> float:
        with torch.device("meta"):
            vae = AutoencoderKLWan().to(dtype).eval()
        x = torch.empty(1, 3, frames, 720, 1280, device="meta", dtype=dtype)
        with torch.inference_mode(), LiveBytes() as live:
            assert vae.encode(x).latent_dist.mean.shape == (1, 16, (frames - 1) // 4 + 1, 90, 160)
        return live.peak / GiB

    umt5 = 5_680_910_336 * 2 / GiB  # bf16 weights, resident while clips encode
    clip = peak(81, torch.bfloat16)
    assert abs(clip - peak(17, torch.bfloat16)) < 0.5 and clip < 7  # 64 more frames: the latents grow, not the peak
    assert get_preset("wan2.1-t2v-14b").vae.cuda_dtype == "bf16"
    assert umt5 + 126_892_531 * 2 / GiB + clip < 22
    assert umt5 + 126_892_531 * 4 / GiB + peak(81, torch.float32) > 22


def test_the_tiny_clip_encodes_fast():
    """A tiny-wan clip of 17 frames at 64x64 encodes in well under a second (about 0.1 s on an idle core; the bound
    leaves room for a busy machine and still catches a tiny model grown out of CPU size)."""
    import time

    enc = Encoders(get_preset("tiny-wan"), CPU)
    pixels = clips(1, 17, 64, 64)
    enc.encode_videos(pixels)  # warm up
    start = time.perf_counter()
    out = enc.encode_videos(pixels)
    assert out["latent_mean"].shape == (1, 16, 5, 8, 8)
    assert time.perf_counter() - start < 3.0


def test_a_real_image_to_video_preset_loads_every_part_from_its_repository(tmp_path, monkeypatch):
    """wan2.1-i2v-14b-480p from a Hugging Face cache snapshot of its repository (the tiny components in its layout):
    the VAE, umT5, the CLIP image encoder and its processor load with `from_pretrained` and encode as the tiny preset;
    without a copy, the error names every folder the encoders read."""
    from huggingface_hub import constants

    from precompute.presets import weights_sources

    preset = get_preset("wan2.1-i2v-14b-480p")
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE is set") as e:
        weights_sources(preset)
    assert (f"hf download {wan.WAN21_I2V_480P} --include 'vae/*' 'image_encoder/*' 'image_processor/*' 'text_encoder/*' "
            f"'tokenizer/*' --local-dir DIR") in str(e.value)
    repo = tmp_path / "hub" / f"models--{wan.WAN21_I2V_480P.replace('/', '--')}"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    save_tiny(get_preset("tiny-wan-i2v"), repo / "snapshots" / commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    enc = Encoders(preset, CPU)
    assert enc.fingerprint()["first_frame"]["image_encoder"]["source"] == wan.WAN21_I2V_480P
    pixels = clips(1, 5, 64, 64, seed=4)
    got, tiny = enc.encode_videos(pixels), Encoders(get_preset("tiny-wan-i2v"), CPU).encode_videos(pixels)
    assert list(got) == ["latent_mean", "latent_std", "condition", "image_embeds"]
    assert all(torch.equal(got[k], tiny[k]) for k in got)

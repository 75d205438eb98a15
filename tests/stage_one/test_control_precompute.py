"""Stage one with --control: every image's control image is found beside it (per input kind), given the image's
resize and crop, encoded as the stock diffusers ControlNet pipelines encode it, and cached as the control latent."""

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from control_testing import RUN, failures, png, sidecar_folder, triples
from PIL import Image

from precompute.config import PrecomputeConfig
from precompute.folders import list_folder
from precompute.images import Record, prepare
from precompute.run import main as precompute
from shards import Cache, load

pytestmark = pytest.mark.model  # builds tiny diffusers / transformers models (left out of make test-fast)

POLICY = PrecomputeConfig("unused", control=True).policy()


@pytest.fixture(scope="module")
def items():
    return triples(3, seed=1)


@pytest.fixture(scope="module")
def control_latents(items, tmp_path_factory):
    """caption -> the tiny-sana latent of each control image encoded as a training image of its own (the same size
    as its image, so the same bucket, resize and crop): what a sample's control latent must be, whatever the input."""
    root = tmp_path_factory.mktemp("reference")
    data = root / "data"
    data.mkdir()
    for i, (_, control, caption) in enumerate(items):
        control.save(data / f"{i:03d}.png")
        (data / f"{i:03d}.txt").write_text(caption)
    precompute(str(data), "tiny-sana", root / "cache", **RUN)
    c = Cache(root / "cache")
    captions = {f"{i:03d}.png": caption for i, (_, _, caption) in enumerate(items)}
    return {captions[bytes(c[i]["source"].tolist()).decode()]: c[i]["latent"] for i in range(len(c))}


def check_pairs(cache, items, control_latents, caption_of) -> None:
    """Every sample of `cache` holds the control latent of its own image's control image; `caption_of(sample)`
    says which image it is."""
    c = Cache(cache)
    assert len(c) == len(items)
    for i in range(len(c)):
        s = c[i]
        torch.testing.assert_close(s["control_latent"], control_latents[caption_of(s)], rtol=0, atol=0)
        assert not torch.equal(s["control_latent"], s["latent"])


# ---- the cached control latent is the stock pipeline's ------------------------------------------------------

def resized_and_cropped(img: Image.Image, original_size, crop) -> Image.Image:
    """An image (or its control image, of any size of the same shape) given the resize and crop the cache records
    for its sample: resized to cover the bucket from the original size, then cropped at (top, left)."""
    (h, w), (top, left, bh, bw) = original_size, crop
    scale = max(bh / h, bw / w)
    size = (max(bw, round(w * scale)), max(bh, round(h * scale)))
    return img.resize(size, Image.BICUBIC).crop((left, top, left + bw, top + bh))


@pytest.mark.parametrize("model", ["tiny-sd3", "tiny-sana"])
def test_control_latents_equal_the_stock_controlnet_pipeline(tmp_path, model):
    """Each cached control latent is what StableDiffusion3ControlNetPipeline / SanaControlNetPipeline compute from
    the control image cropped as its image (their `prepare_image`, then `vae.encode`), with the VAE the cache
    stored; a control image at half the image's size is resized to the image's resized size first."""
    import diffusers

    items = triples(3, seed=2)
    data = sidecar_folder(tmp_path / "data", items)
    half = items[1][1].resize((items[1][1].width // 2, items[1][1].height // 2), Image.BICUBIC)
    half.save(data / "001.control.png")  # another size of the same shape
    controls = [items[0][1], half, items[2][1]]
    cache = tmp_path / "cache"
    summary = precompute(str(data), model, cache, control=True, **RUN)
    assert summary["new"] == 3 and summary["failed"] == 0

    c = Cache(cache)
    vae_class = diffusers.AutoencoderKL if model == "tiny-sd3" else diffusers.AutoencoderDC
    vae = vae_class.from_pretrained(cache / "vae").eval()  # the weights the cache was encoded with
    if model == "tiny-sd3":
        pipe = diffusers.StableDiffusion3ControlNetPipeline(
            transformer=None, scheduler=None, vae=vae, text_encoder=None, tokenizer=None, text_encoder_2=None,
            tokenizer_2=None, text_encoder_3=None, tokenizer_3=None, controlnet=None)
    else:
        pipe = diffusers.SanaControlNetPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=None,
                                                controlnet=None, scheduler=None)
    scaling, shift = vae.config.scaling_factor, getattr(vae.config, "shift_factor", None) or 0.0
    for i in range(len(c)):
        s = c[i]
        n = int(bytes(s["source"].tolist()).decode()[:3])
        crop, original = s["crop"].tolist(), s["original_size"].tolist()
        height, width = crop[2], crop[3]
        assert (s.bucket.height, s.bucket.width) == (height, width)

        def pipeline_input(img):
            return pipe.prepare_image(resized_and_cropped(img, original, crop), width=width, height=height, batch_size=1,
                                      num_images_per_prompt=1, device="cpu", dtype=torch.float32)

        with torch.no_grad():
            control = pipeline_input(controls[n])
            image = pipeline_input(items[n][0])
            if model == "tiny-sd3":
                dist = vae.encode(control).latent_dist
                torch.testing.assert_close(s["control_latent_mean"], ((dist.mean - shift) * scaling)[0], rtol=1e-6, atol=1e-6)
                torch.testing.assert_close(s["control_latent_std"], (dist.std * scaling)[0], rtol=1e-6, atol=1e-6)
                # the pipeline's draw, `(latent_dist.sample() - shift) * scaling`, is the cached mean + std * its noise
                drawn = (dist.sample(generator=torch.Generator().manual_seed(i)) - shift) * scaling
                noise = torch.randn(dist.mean.shape, generator=torch.Generator().manual_seed(i))[0]
                torch.testing.assert_close(s["control_latent_mean"] + s["control_latent_std"] * noise, drawn[0],
                                           rtol=1e-5, atol=1e-5)
                # the image itself was resized and cropped the same way
                image_mean = (vae.encode(image).latent_dist.mean - shift) * scaling
                torch.testing.assert_close(s["latent_mean"], image_mean[0], rtol=1e-6, atol=1e-6)
            else:
                torch.testing.assert_close(s["control_latent"], (vae.encode(control).latent * scaling)[0], rtol=1e-6, atol=1e-6)
                torch.testing.assert_close(s["latent"], (vae.encode(image).latent * scaling)[0], rtol=1e-6, atol=1e-6)


def test_a_control_image_gets_exactly_the_image_resize_and_crop():
    """The same picture as image and control gives the same pixels; another size of the same shape (within 1 %)
    is resized to match; another shape, an undecodable or an empty control image fails with its reason; EXIF
    rotation and alpha are applied to control images as to images."""
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (300, 200, 3), dtype=np.uint8))  # 200 wide, 300 high: resized and cropped
    data = png(image)
    same = prepare(Record("x.png", data, ["a caption"], control=data), POLICY)
    assert same["status"] == "ok" and torch.equal(same["control_pixels"], same["pixels"])

    smooth = image.resize((20, 30)).resize((200, 300), Image.BICUBIC)
    half = prepare(Record("x.png", png(smooth), ["a caption"], control=png(smooth.resize((100, 150), Image.BICUBIC))), POLICY)
    assert half["status"] == "ok" and half["control_pixels"].shape == half["pixels"].shape
    assert (half["control_pixels"].float() - half["pixels"].float()).abs().mean() < 8  # the same picture, resampled
    near = prepare(Record("x.png", data, ["a caption"], control=png(image.resize((201, 300)))), POLICY)  # 0.5 % wider
    assert near["status"] == "ok"

    def reason(control: bytes) -> tuple[str, str]:
        out = prepare(Record("x.png", data, ["a caption"], control=control), POLICY)
        return out["status"], out.get("reason")

    assert reason(png(image.resize((204, 300)))) == ("failed", "control_aspect")  # 2 % wider
    assert reason(png(image.resize((300, 200)))) == ("failed", "control_aspect")  # transposed
    assert reason(b"not an image at all") == ("failed", "corrupt_control")
    assert reason(data[: len(data) // 2]) == ("failed", "corrupt_control")
    assert reason(b"") == ("failed", "corrupt_control")
    missing = prepare(Record("x.png", data, ["a caption"], control_detail="no x.control.png"), POLICY)
    assert (missing["reason"], missing["detail"]) == ("missing_control", "no x.control.png")

    # stored rotated, with an EXIF orientation: its displayed shape is the image's
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    buf = io.BytesIO()
    smooth.rotate(90, expand=True).save(buf, format="JPEG", exif=exif, quality=98)
    rotated = prepare(Record("x.png", png(smooth), ["a caption"], control=buf.getvalue()), POLICY)
    assert rotated["status"] == "ok" and (rotated["control_pixels"].float() - rotated["pixels"].float()).abs().mean() < 8
    # alpha composited on white, as for images
    clear = prepare(Record("x.png", data, ["a caption"], control=png(Image.new("RGBA", (200, 300), (0, 0, 0, 0)))), POLICY)
    assert bool((clear["control_pixels"] == 255).all())
    # without --control, a control image is not read, and the key is the image's and captions' alone
    plain = prepare(Record("x.png", data, ["a caption"], control=data), PrecomputeConfig("unused").policy())
    assert "control_pixels" not in plain and plain["key"] != same["key"]


# ---- where control images are found --------------------------------------------------------------------------

def test_folder_sidecars_are_control_images_and_never_images(tmp_path, items, control_latents):
    data = sidecar_folder(tmp_path / "data", items)
    (data / "sub").mkdir()
    items[0][1].save(data / "sub" / "orphan.control.jpg")  # a control image without an image: listed by nobody
    assert [e.source for e in list_folder(data).entries] == ["000.png", "001.png", "002.png"]  # also without --control
    listing = list_folder(data, control=True)
    assert [Path(e.control).name for e in listing.entries] == ["000.control.png", "001.control.png", "002.control.png"]
    # read by two loader workers: control pixels cross the process boundary as the image's do
    summary = precompute(str(data), "tiny-sana", tmp_path / "cache", control=True, **{**RUN, "workers": 2})
    assert summary["new"] == 3 and summary["failed"] == 0
    caption_of = {f"{i:03d}.png": caption for i, (_, _, caption) in enumerate(items)}
    check_pairs(tmp_path / "cache", items, control_latents, lambda s: caption_of[bytes(s["source"].tolist()).decode()])
    # a plain run of the same folder caches the three images, not their control images
    assert precompute(str(data), "tiny-sana", tmp_path / "plain", **RUN)["new"] == 3


def test_a_metadata_column_names_control_images_and_sidecars_work_beside_it(tmp_path, items, control_latents):
    data = tmp_path / "data"
    (data / "images").mkdir(parents=True)
    (data / "conditioning").mkdir()
    rows = []
    for i, (img, control, caption) in enumerate(items):
        img.save(data / "images" / f"{i}.png")
        if i < 2:
            control.save(data / "conditioning" / f"c{i}.png")
            rows.append({"file_name": f"images/{i}.png", "text": caption, "control_file_name": f"conditioning/c{i}.png"})
        else:  # no control_file_name: the sidecar beside the image
            control.save(data / "images" / f"{i}.control.png")
            rows.append({"file_name": f"images/{i}.png", "text": caption})
    items[0][0].save(data / "images" / "3.png")
    rows.append({"file_name": "images/3.png", "text": "escapes", "control_file_name": "../outside.png"})
    (data / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = precompute(str(data), "tiny-sana", tmp_path / "cache", control=True, **RUN)
    assert summary["new"] == 3 and failures(tmp_path / "cache") == {"images/3.png": "outside_root"}
    caption_of = {f"images/{i}.png": caption for i, (_, _, caption) in enumerate(items)}
    check_pairs(tmp_path / "cache", items, control_latents, lambda s: caption_of[bytes(s["source"].tolist()).decode()])


def test_a_tar_sample_control_member_is_its_control_image(tmp_path, items, control_latents):
    tar_path = tmp_path / "tars" / "data-0000.tar"
    tar_path.parent.mkdir()
    with tarfile.open(tar_path, "w") as tar:
        for i, (img, control, caption) in enumerate(items):
            members = [("jpg" if i == 0 else "png", png(img, "JPEG" if i == 0 else "PNG")), ("txt", caption.encode()),
                       ("control.png", png(control))]
            for ext, blob in members:
                info = tarfile.TarInfo(f"{i:06d}.{ext}")
                info.size = len(blob)
                tar.addfile(info, io.BytesIO(blob))
    summary = precompute(str(tar_path), "tiny-sana", tmp_path / "cache", control=True, **RUN)
    assert summary["new"] == 3 and summary["failed"] == 0
    caption_of = {f"data-0000.tar/{i:06d}": caption for i, (_, _, caption) in enumerate(items)}
    check_pairs(tmp_path / "cache", items, control_latents, lambda s: caption_of[bytes(s["source"].tolist()).decode()])


def test_a_hugging_face_dataset_control_image_column_and_its_rename(tmp_path, items, control_latents):
    datasets = pytest.importorskip("datasets")

    def saved(path: Path, control_column: str) -> Path:
        ds = datasets.Dataset.from_dict({"image": [{"bytes": png(img), "path": None} for img, _, _ in items],
                                         "text": [caption for _, _, caption in items],
                                         control_column: [{"bytes": png(control), "path": None} for _, control, _ in items]})
        ds.cast_column("image", datasets.Image()).cast_column(control_column, datasets.Image()).save_to_disk(str(path))
        return path

    caption_of = {f"{i}": caption for i, (_, _, caption) in enumerate(items)}
    summary = precompute(str(saved(tmp_path / "hf", "control_image")), "tiny-sana", tmp_path / "cache", control=True, **RUN)
    assert summary["new"] == 3 and summary["failed"] == 0
    check_pairs(tmp_path / "cache", items, control_latents, lambda s: caption_of[bytes(s["source"].tolist()).decode().rsplit(":")[-1]])

    saved(tmp_path / "renamed", "conditioning_image")
    with pytest.raises(ValueError, match="no control column 'control_image'.*control_column"):
        precompute(str(tmp_path / "renamed"), "tiny-sana", tmp_path / "other", control=True, **RUN)
    file = tmp_path / "data.toml"
    file.write_text(f'[[source]]\npath = "{tmp_path / "renamed"}"\ncontrol_column = "conditioning_image"\n')
    summary = precompute(str(file), "tiny-sana", tmp_path / "other", control=True, **RUN)
    assert summary["new"] == 3 and summary["failed"] == 0
    check_pairs(tmp_path / "other", items, control_latents, lambda s: caption_of[bytes(s["source"].tolist()).decode().rsplit(":")[-1]])


def test_a_dataset_file_control_folder_holds_control_images_by_relative_name(tmp_path, items, control_latents):
    data, controls = tmp_path / "photos", tmp_path / "photos-edges"
    for i, (img, control, caption) in enumerate(items):
        sub = "a" if i < 2 else "b"
        for d in (data / sub, controls / sub):
            d.mkdir(parents=True, exist_ok=True)
        img.save(data / sub / f"{i}.png")
        (data / sub / f"{i}.txt").write_text(caption)
        control.save(controls / sub / f"{i}.bmp")  # any image extension, here lossless as the png
        if i == 0:
            items[2][1].save(data / sub / f"{i}.control.png")  # a sidecar is not what a control folder pairs
    file = tmp_path / "data.toml"
    file.write_text('[[source]]\npath = "photos"\ncontrol = "photos-edges"\n')  # relative to the file
    summary = precompute(str(file), "tiny-sana", tmp_path / "cache", control=True, **RUN)
    assert summary["new"] == 3 and summary["failed"] == 0
    caption_of = {f"{'a' if i < 2 else 'b'}/{i}.png": caption for i, (_, _, caption) in enumerate(items)}
    check_pairs(tmp_path / "cache", items, control_latents, lambda s: caption_of[bytes(s["source"].tolist()).decode()])
    assert load(tmp_path / "cache").extra["sources"]["photos"]["control"] == str(controls)

    (controls / "b" / "2.bmp").unlink()
    summary = precompute(str(file), "tiny-sana", tmp_path / "cache", control=True, **RUN)
    assert summary["failed_by_reason"] == {"missing_control": 1} and summary["unchanged"] == 2
    assert len(Cache(tmp_path / "cache")) == 3  # a sample whose input fails to read is kept, as for every failure


def test_a_sidecar_in_another_case_and_a_control_folder_inside_the_images_folder(tmp_path, items, control_latents):
    # a metadata row's sidecar is matched as the folder walk matches files: the extension in any case
    data = tmp_path / "data"
    data.mkdir()
    for i, (img, control, caption) in enumerate(items):
        img.save(data / f"{i}.png")
        control.save(data / f"{i}.control.PNG", format="PNG")
    (data / "metadata.jsonl").write_text("".join(json.dumps({"file_name": f"{i}.png", "text": c}) + "\n"
                                                 for i, (_, _, c) in enumerate(items)))
    summary = precompute(str(data), "tiny-sana", tmp_path / "cache", control=True, **RUN)
    assert summary["new"] == len(items) and summary["failed"] == 0
    caption_of = {f"{i}.png": caption for i, (_, _, caption) in enumerate(items)}
    check_pairs(tmp_path / "cache", items, control_latents, lambda s: caption_of[bytes(s["source"].tolist()).decode()])

    # a source's control folder inside its own folder holds controls, not images
    photos = tmp_path / "photos"
    (photos / "edges").mkdir(parents=True)
    for i, (img, control, caption) in enumerate(items):
        img.save(photos / f"{i}.png")
        (photos / f"{i}.txt").write_text(caption)
        control.save(photos / "edges" / f"{i}.png")
    file = tmp_path / "data.toml"
    file.write_text('[[source]]\npath = "photos"\ncontrol = "photos/edges"\n')
    summary = precompute(str(file), "tiny-sana", tmp_path / "cache-2", control=True, **RUN)
    assert summary["new"] == len(items) and summary["failed"] == 0
    check_pairs(tmp_path / "cache-2", items, control_latents, lambda s: caption_of[bytes(s["source"].tolist()).decode()])


# ---- failures, the fingerprint, incremental runs -----------------------------------------------------------------



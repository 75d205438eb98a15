import pytest

from shards import ASPECT_RATIO_TABLES, Bucket, aspect_error, bucket_table, nearest_bucket


def test_tables_equal_the_published_diffusers_tables():
    from diffusers.pipelines.pixart_alpha.pipeline_pixart_alpha import (
        ASPECT_RATIO_256_BIN,
        ASPECT_RATIO_512_BIN,
        ASPECT_RATIO_1024_BIN,
    )
    from diffusers.pipelines.pixart_alpha.pipeline_pixart_sigma import ASPECT_RATIO_2048_BIN

    published = {256: ASPECT_RATIO_256_BIN, 512: ASPECT_RATIO_512_BIN, 1024: ASPECT_RATIO_1024_BIN, 2048: ASPECT_RATIO_2048_BIN}
    for base, table in published.items():
        assert list(ASPECT_RATIO_TABLES[base]) == [Bucket(int(h), int(w)) for h, w in table.values()], base


def test_buckets_are_integers_and_named_h_x_w():
    for table in ASPECT_RATIO_TABLES.values():
        for b in table:
            assert isinstance(b.height, int) and isinstance(b.width, int)
    assert Bucket.parse("1024x768") == Bucket(1024, 768)
    assert Bucket(1024, 768).name == "1024x768"
    with pytest.raises(ValueError, match="HEIGHTxWIDTH"):
        Bucket.parse("1.33")


def test_nearest_bucket():
    table = bucket_table(1024)
    assert nearest_bucket(1000, 1000, table) == Bucket(1024, 1024)
    assert nearest_bucket(3000, 2000, table) == Bucket(1216, 832)  # 3:2 portrait
    assert nearest_bucket(2000, 3000, table) == Bucket(832, 1216)
    assert nearest_bucket(100, 10_000, table) == Bucket(512, 2048)  # clamps to the widest
    assert aspect_error(1000, 1000, Bucket(1024, 1024)) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="base resolution 300"):
        bucket_table(300)


def test_scaled_tables_are_built_as_the_published_ones():
    """The 256 and 512 tables are the 1024 table scaled to their area; building them from it gives them back."""
    from shards.buckets import scaled_table

    assert scaled_table(1024, 64) == ASPECT_RATIO_TABLES[1024]
    assert scaled_table(512, 32) == ASPECT_RATIO_TABLES[512]
    assert scaled_table(256, 16) == ASPECT_RATIO_TABLES[256]


def test_resolution_table_published_where_it_fits_else_built():
    from shards import resolution_table

    assert resolution_table(512, 16) == ASPECT_RATIO_TABLES[512]
    assert resolution_table(1024, 32) == ASPECT_RATIO_TABLES[1024]
    assert resolution_table(2048, 16) == ASPECT_RATIO_TABLES[2048]
    # the published 256 table has sides of 16 px steps (144x464): a 32 px model gets one built at that granularity
    built = resolution_table(256, 32)
    assert built != ASPECT_RATIO_TABLES[256] and Bucket(256, 256) in built
    assert all(b.height % 32 == 0 and b.width % 32 == 0 for b in built)
    for granularity in (16, 32):
        table = resolution_table(768, granularity)
        assert Bucket(768, 768) in table and table[0] == Bucket(384, 1536) and table[-1] == Bucket(1536, 384)
        assert all(b.height % granularity == 0 and b.width % granularity == 0 for b in table)
        # every bucket keeps about the area, and the aspect ratio of its 1024 bucket
        assert all(0.85 < b.height * b.width / 768**2 < 1.15 for b in table)
        assert len(set(table)) == len(table) and len(table) == len(ASPECT_RATIO_TABLES[1024])
        assert all(aspect_error(ref.height, ref.width, b) < 1.06 for b, ref in zip(table, ASPECT_RATIO_TABLES[1024]))
    assert resolution_table(768, 16)[1] == Bucket(384, 1392) and resolution_table(768, 32)[1] == Bucket(384, 1408)


def test_resolution_problem_names_the_range():
    from shards.buckets import resolution_problem

    assert resolution_problem(512, 2048) is None and resolution_problem(2048, 2048) is None
    for bad in (500, 192, 4096, 0, "512"):
        assert "multiple of 64 from 256 to 2048" in resolution_problem(bad, 2048) or "whole number" in resolution_problem(bad, 2048)


def test_a_clip_bucket_has_frames_and_an_image_bucket_is_as_it_always_was():
    clip = Bucket.parse("81x480x832")
    assert (clip.frames, clip.height, clip.width, clip.name, str(clip)) == (81, 480, 832, "81x480x832", "81x480x832")
    assert Bucket.parse("480x832") == Bucket(480, 832) == Bucket(480, 832, 0) and Bucket(480, 832).name == "480x832"
    assert Bucket(480, 832).with_frames(17) == Bucket(480, 832, 17) != Bucket(480, 832, 33)
    for bad in ("0x480x832", "480", "1x2x3x4"):
        with pytest.raises(ValueError, match="FRAMESxHEIGHTxWIDTH|at least one frame"):
            Bucket.parse(bad)

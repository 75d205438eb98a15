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

"""The strict config loader: the repository's config loads; an unknown key (such as the file-format facts
that are now constants of nanoqwen/nqfile.py and nanoqwen/quant.py) or a missing key is an error naming it."""

import pytest
import yaml

from nanoqwen.config import ConfigError, load
from nanoqwen.paths import data_path

DEFAULT_PATH = data_path("config", "nanoqwen.yaml")


def _write(tmp_path, data):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_repository_config_loads():
    cfg = load(DEFAULT_PATH)
    assert cfg.quant.group_size == 128 and not hasattr(cfg, "file")


@pytest.mark.parametrize("section, key, value", [
    (None, "file", {"magic": "NANOQWEN", "version": 1, "header_bytes": 256, "alignment": 128}),
    ("quant", "packed_layout", [0, 2, 4, 6, 1, 3, 5, 7]),
    ("quant", "layout_id", 1),
])
def test_format_facts_are_not_config_keys(tmp_path, section, key, value):
    data = yaml.safe_load(DEFAULT_PATH.read_text())
    (data[section] if section else data)[key] = value
    with pytest.raises(ConfigError, match=rf"^unknown config key '{section + '.' if section else ''}{key}'$"):
        load(_write(tmp_path, data))


@pytest.mark.parametrize("value", [0, -64, 96, 100])
def test_attention_block_keys_are_whole_kv_tiles(tmp_path, value):
    data = yaml.safe_load(DEFAULT_PATH.read_text())
    data["prefill"]["attention_block_keys"] = value
    with pytest.raises(ConfigError, match=rf"^prefill.attention_block_keys must be a positive multiple of 64, got {value}$"):
        load(_write(tmp_path, data))


@pytest.mark.parametrize("value", [[16, 8], [8, 8], [0, 8], [8, 5000]])
def test_graph_buckets_rise_within_the_chunk_limit(tmp_path, value):
    data = yaml.safe_load(DEFAULT_PATH.read_text())
    data["prefill"]["graph_buckets"] = value
    with pytest.raises(ConfigError, match=r"^prefill.graph_buckets must rise strictly within 1..4096, got "):
        load(_write(tmp_path, data))


@pytest.mark.parametrize("value", [-2, 101])
def test_smem_carveout_is_a_percentage_or_the_drivers_choice(tmp_path, value):
    data = yaml.safe_load(DEFAULT_PATH.read_text())
    data["launch"]["smem_carveout"] = value
    with pytest.raises(ConfigError, match=rf"^launch.smem_carveout must be -1 .* 0..100, got {value}$"):
        load(_write(tmp_path, data))


def test_no_graph_buckets_is_allowed(tmp_path):
    data = yaml.safe_load(DEFAULT_PATH.read_text())
    data["prefill"]["graph_buckets"] = []
    assert load(_write(tmp_path, data)).prefill.graph_buckets == ()


def test_missing_key_is_named(tmp_path):
    data = yaml.safe_load(DEFAULT_PATH.read_text())
    del data["quant"]["group_size"]
    with pytest.raises(ConfigError, match=r"^missing config key 'quant\.group_size'$"):
        load(_write(tmp_path, data))

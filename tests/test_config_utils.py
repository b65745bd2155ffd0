"""The shared config helpers: ``path:arg`` loading, and one refusal of unknown keys for
``--config.*`` flags (`check_overrides`) and for sections given as dicts (`merge_section`)."""
import pathlib

import ml_collections
import pytest

from ace_jax import config_utils

REPO = pathlib.Path(__file__).resolve().parents[1]


def _defaults():
    c = ml_collections.ConfigDict()
    c.history = 3
    c.rate = 0.5
    c.kinds = ("a", "b")
    c.store = ml_collections.ConfigDict(dict(url="", retries=2))
    return c


def test_split_config_arg():
    assert config_utils.split_config_arg("configs/local.py:smoke") == ("configs/local.py", "smoke")
    assert config_utils.split_config_arg("configs/local.py") == ("configs/local.py", None)
    assert config_utils.split_config_arg("gs://b/x") == ("gs://b/x", None)


def test_load_config_file_with_an_arg(tmp_path):
    assert config_utils.load_config_file(str(REPO / "configs/local.py:smoke")).rl.num_steps == 5
    plain = tmp_path / "plain.py"
    plain.write_text("def get_config():\n    return {}\n")
    with pytest.raises(ValueError, match="takes no argument"):
        config_utils.load_config_file(f"{plain}:x")
    with pytest.raises(FileNotFoundError):
        config_utils.load_config_file(str(tmp_path / "absent.py"))


def test_flat_dict():
    assert config_utils.flat_dict(_defaults()) == {
        "history": 3, "kinds": ("a", "b"), "rate": 0.5, "store.retries": 2, "store.url": ""}


def test_check_overrides_lists_the_siblings():
    c = config_utils.load_config_file(str(REPO / "configs/local.py"))
    config_utils.check_overrides(c, ["--config.rl.group_size=2", "--config.model.overrides",
                                     "--other.x=1"])
    with pytest.raises(config_utils.ConfigKeyError) as e:
        config_utils.check_overrides(c, ["--config.rl.grup_size=3"])
    msg = str(e.value)
    assert msg.startswith("--config.rl.grup_size: no such config key. Did you mean rl.group_size")
    assert "Valid keys under rl:\n  rl.batch_states" in msg and "sampling." not in msg


def test_merge_section_sets_known_keys_and_refuses_unknown_ones():
    d = _defaults()
    out = config_utils.merge_section(d, {"history": 5, "rate": 1, "kinds": ["c"],
                                         "store": {"url": "gs://b"}}, "buffer")
    assert config_utils.flat_dict(out) == {"history": 5, "kinds": ("c",), "rate": 1.0,
                                           "store.retries": 2, "store.url": "gs://b"}
    assert d.history == 3 and d.store.url == ""            # the defaults are not touched
    assert config_utils.merge_section(d, None, "buffer").to_dict() == d.to_dict()
    with pytest.raises(config_utils.ConfigKeyError) as e:
        config_utils.merge_section(d, {"histroy": 5}, "buffer")
    msg = str(e.value)
    assert msg.startswith("buffer.histroy: no such config key. Did you mean buffer.history")
    assert "buffer.store.url" in msg
    with pytest.raises(config_utils.ConfigKeyError, match="Valid keys under buffer.store"):
        config_utils.merge_section(d, {"store": {"uri": "x"}}, "buffer")


def test_merge_section_ignore_and_types():
    d = _defaults()
    out = config_utils.merge_section(d, {"old_knob": 1, "store": {"gone": 2}}, "buffer",
                                     ignore=("old_knob", "store.gone"))
    assert out.to_dict() == d.to_dict()
    with pytest.raises(config_utils.ConfigError, match="buffer.history"):
        config_utils.merge_section(d, {"history": "many"}, "buffer")
    with pytest.raises(config_utils.ConfigError, match="buffer.store is a section"):
        config_utils.merge_section(d, {"store": "gs://b"}, "buffer")

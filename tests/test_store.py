"""The tuned-config store: the user's cache directory over the shipped file, corrupt files ignored with a warning."""

import json
import warnings
from dataclasses import dataclass

import pytest

import autotune
from autotune import config as cfgmod


@dataclass(frozen=True)
class Cfg:
    block: int = 64
    warps: int = 4


KEY = autotune.shape_key(M=8, N=5120, K=6144)


def _get():
    return autotune.get_config("w", "v", Cfg, Cfg, key=KEY)


def test_user_cache_takes_precedence(fake_h200):
    shipped = autotune.store_tuned("w", "v", KEY, Cfg(128, 8))
    autotune.store_tuned("w", "v", "M1", Cfg(32, 2))
    assert shipped == fake_h200 / "h200.json"
    assert _get() == Cfg(128, 8)
    user = autotune.store_tuned("w", "v", KEY, Cfg(256, 4), user=True, extra={"over_floor": 1.2})
    assert user == fake_h200.parent / "cache" / "configs" / "h200.json"
    assert _get() == Cfg(256, 4)  # the user's entry wins
    assert autotune.get_config("w", "v", Cfg, Cfg, key="M1") == Cfg(32, 2)  # shipped entries still serve
    assert autotune.drop_tuned("w", "v", KEY, user=True)
    assert _get() == Cfg(128, 8)


def test_user_file_follows_the_policy_on_its_own(fake_h200):
    autotune.store_tuned("w", "v", KEY, Cfg(128, 8))
    path = autotune.store_tuned("w", "v", KEY, Cfg(256, 4), user=True)
    data = json.loads(path.read_text())
    data["meta"]["triton"] = "0.1"
    path.write_text(json.dumps(data))
    cfgmod._TUNED.clear()
    with pytest.warns(UserWarning, match="tuned with Triton 0.1"):
        assert _get() == Cfg(128, 8)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"meta": {}}', '{"meta": {}, "entries": [1]}'])
@pytest.mark.parametrize("user", [False, True])
def test_corrupt_files_are_ignored_with_a_warning(fake_h200, text, user):
    good = autotune.store_tuned("w", "v", KEY, Cfg(128, 8), user=not user)
    bad = cfgmod.tuned_file(user=user)
    bad.parent.mkdir(parents=True, exist_ok=True)
    bad.write_text(text)
    cfgmod._TUNED.clear()
    with pytest.warns(UserWarning, match=r"autotune.load_tuned: ignoring .*h200.json.*fix or delete the file"):
        assert _get() == Cfg(128, 8)  # the other file still serves
    assert good.exists()
    cfgmod._TUNED.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per file and process
        assert _get() == Cfg(128, 8)


def test_store_replaces_a_corrupt_file(fake_h200):
    path = cfgmod.tuned_file(user=True)
    path.parent.mkdir(parents=True)
    path.write_text("{truncated")
    with pytest.warns(UserWarning, match="ignoring"):
        autotune.store_tuned("w", "v", KEY, Cfg(256, 4), user=True)
    assert json.loads(path.read_text())["entries"][f"w/v/{KEY}"] == {"block": 256, "warps": 4}
    assert _get() == Cfg(256, 4)

import pytest


@pytest.fixture
def no_two_launch_split(monkeypatch):
    """Fails the test if inverse='split' launches its two-launch first kernel: a test of the one-launch
    form (handoff='flag') must not pass through the launcher's fallback."""
    import gdn.kernels.wy as wy

    def launch(*args, **kwargs):
        raise AssertionError("handoff='flag' fell back to the two-launch form")

    monkeypatch.setattr(wy, "gdn_tree_split_kernel", type("NoSplit", (), {"__getitem__": lambda self, grid: launch})())

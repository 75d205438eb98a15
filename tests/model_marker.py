"""The `model` marker is kept honest: a test not marked `model` that builds a diffusers or transformers model fails.

`make test-fast` runs the tests that start no model (`-m "not slow and not model"`). A test file that builds one
(a tiny VAE, a text encoder, a transformer) says so with `pytestmark = pytest.mark.model`; this plugin watches
every `torch.nn.Module` built during an unmarked test and fails it, naming the class, when one comes from diffusers
or transformers, so the fast suite cannot quietly grow slow.
"""

from __future__ import annotations

import pytest

MODEL_BASES = {"ModelMixin", "PreTrainedModel"}  # diffusers' and transformers' models (not their activations etc.)
_built: list[str] = []  # model classes built during the running test
_watching = False


def _watch_module_init(init):
    def init_and_record(self, *args, **kwargs):
        if _watching and any(base.__name__ in MODEL_BASES for base in type(self).__mro__[1:]):
            _built.append(f"{type(self).__module__}.{type(self).__qualname__}")
        return init(self, *args, **kwargs)

    return init_and_record


def pytest_configure(config):
    config.addinivalue_line("markers", "model: builds a diffusers / transformers model (left out of `make test-fast`)")
    import torch

    torch.nn.Module.__init__ = _watch_module_init(torch.nn.Module.__init__)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    """Fixtures count: a module's fixture that builds a model runs in its first test's setup."""
    global _watching
    _built.clear()
    _watching = item.get_closest_marker("model") is None
    try:
        return (yield)
    finally:
        _watching = False


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    global _watching
    _watching = item.get_closest_marker("model") is None
    try:
        result = yield
    finally:
        _watching = False
    if _built:
        names = ", ".join(sorted(set(_built))[:3])
        pytest.fail(f"this test builds a model ({names}) but is not marked `model`: add `pytestmark = pytest.mark.model` "
                    f"to its file (or mark the test), so `make test-fast` leaves it out", pytrace=False)
    return result

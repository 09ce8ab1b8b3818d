"""Fixtures the test modules share: the Jinja2 oracle of poot's template interpreter and the
clock both read, the tiny random model, and devices opened the way poot-serve opens them
(backends/select.py), or a skip that says why one cannot open here."""
import datetime
import gc
import json

import pytest

import poot
from poot.backends.select import open_device
from poot.errors import BackendUnavailable
from poot.text import jinja
from tests.models import tiny_model

NOW = datetime.datetime(2024, 7, 26, 13, 45)


def open_or_skip(backend):
    try:
        return open_device(backend)
    except BackendUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module", params=["ptx", "rocm", "vulkan", "wgpu"])
def device(request):
    """Each backend's device 0 in turn."""
    return open_or_skip(request.param)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny random Llama (tests/models.py), loaded."""
    return poot.load(tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture
def fixed_clock(monkeypatch):
    """poot's `strftime_now` reads NOW, as the oracle's does."""
    monkeypatch.setattr(jinja, "clock", lambda: NOW)


@pytest.fixture(scope="session")
def hf_jinja():
    """Jinja2 exactly as transformers' chat-template renderer builds it, the clock fixed at NOW."""
    jinja2 = pytest.importorskip("jinja2")
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: NOW.strftime(fmt)
    return env


def pytest_sessionfinish(session, exitstatus):
    """Freezes what the session made (kernels' statement trees, models, devices) so that the
    interpreter's finalization, which collects garbage again and again, skips it: exit is then
    seconds, not minutes over a heap of many GB."""
    gc.freeze()

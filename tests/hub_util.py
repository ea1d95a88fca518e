"""A real huggingface_hub cache, populated from local folders, for the hub-id tests (no network).

``cache_repo`` writes huggingface_hub's own cache layout under ``$HF_HOME/hub``: the files as blobs
named by their sha256, a snapshot folder ``snapshots/<commit>/`` of relative symlinks to them, and
``refs/<branch or tag>`` holding the commit, exactly as ``snapshot_download`` leaves a download. A
process with ``HF_HOME`` pointing there and ``HF_HUB_OFFLINE=1`` resolves the repo from it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def cache_repo(hf_home: Path, repo_id: str, source: Path, repo_type: str = "model", refs: tuple[str, ...] = ("main",)) -> str:
    """Put every file under ``source`` into the cache as one commit of ``repo_id``; returns the commit hash."""
    files = sorted(p for p in source.rglob("*") if p.is_file())
    commit = hashlib.sha1(b"".join(hashlib.sha256(p.read_bytes()).digest() for p in files)).hexdigest()
    repo = hf_home / "hub" / f"{repo_type}s--{repo_id.replace('/', '--')}"
    for path in files:
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / commit / path.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return commit


def run_python(code: str, hf_home: Path, offline: bool = True, extra_env: dict | None = None, timeout: float = 120):
    """Run ``code`` in a fresh interpreter with ``HF_HOME`` (and ``HF_HUB_OFFLINE``) set as a user would
    set them: huggingface_hub reads them when it is imported."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1" if offline else "0", HF_HUB_DISABLE_TELEMETRY="1")
    env.update(extra_env or {})
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests")])
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)

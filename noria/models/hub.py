"""Hub ids: ``Org/Name`` (optionally pinned as ``Org/Name@revision``) resolved to a local snapshot
folder through ``huggingface_hub.snapshot_download``.

Used for ``model.path`` (``noria.models.catalog.model_path``) and ``data.path`` / ``data.test_path``
(``noria.data.hub``). The download, the cache and its layout are huggingface_hub's own: the cache is
``$HF_HUB_CACHE`` (default ``$HF_HOME/hub``), ``HF_HUB_OFFLINE=1`` resolves from that cache with no
network, ``HF_ENDPOINT`` names a mirror, ``HF_TOKEN`` a token. The revision after ``@`` is a branch, a
tag or a commit hash; without one, the repo's ``main``. The pin travels inside the path string, so
every process that loads the model (engines, trainer ranks, evaluation) resolves the same snapshot.

What counts as a hub id: a string of the form ``Org/Name`` (one slash, the characters the hub allows)
that is not an existing local path; an existing folder of that name always wins. When the hub cannot
answer (no network, offline with nothing cached, an unknown repo or revision), :class:`HubError`
says what was tried (the id, the revision, the cache folder, ``HF_HOME``, offline or not, the
endpoint) and how to pass a local folder instead.

Not guaranteed: a gated or private repo needs a token (``HF_TOKEN`` or ``hf auth login``); Noria does
not manage it. Two processes resolving the same id at once both call huggingface_hub, whose own
file locks keep the cache consistent.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from noria.errors import NoriaError

HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+)(?:@(?P<revision>[^\s@]+))?")
"""``Org/Name`` or ``Org/Name@revision``."""


class HubError(NoriaError):
    """A hub id could not be resolved; the message says what was tried and how to pass a local folder."""


def parse_hub_id(value: str | os.PathLike) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``value`` is a hub id and no local path of that name exists, else None."""
    if not isinstance(value, str) or Path(value).expanduser().exists():
        return None
    match = HUB_ID.fullmatch(value)
    if match is None or match["repo"].endswith((".", "..")) or ".." in match["repo"]:
        return None
    return match["repo"], match["revision"]


def is_hub_id(value: str | os.PathLike) -> bool:
    """Whether ``value`` names a hub repo (``Org/Name[@revision]``) rather than a local path."""
    return parse_hub_id(value) is not None


def snapshot(value: str, repo_type: str = "model", key: str = "model.path") -> Path:
    """The local snapshot folder of hub id ``value`` (downloaded into the cache when online)."""
    parsed = parse_hub_id(value)
    if parsed is None:
        raise HubError(f"{key}: {value!r} is not a hub id of the form Org/Name or Org/Name@revision")
    repo_id, revision = parsed
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision))
    except Exception as e:  # huggingface_hub raises many types (HTTP, offline, not found, validation); all mean "not here"
        raise HubError(_not_found(key, value, repo_id, revision, repo_type, e)) from e


def hub_context() -> dict[str, str]:
    """What huggingface_hub uses here: the cache folder, HF_HOME, offline or not, the endpoint."""
    from huggingface_hub import constants

    return {
        "cache": str(constants.HF_HUB_CACHE),
        "HF_HOME": os.environ.get("HF_HOME", f"(unset: {constants.HF_HOME})"),
        "HF_HUB_OFFLINE": "1" if constants.HF_HUB_OFFLINE else "0",
        "endpoint": str(constants.ENDPOINT),
    }


def _not_found(key: str, value: str, repo_id: str, revision: str | None, repo_type: str, error: Exception) -> str:
    ctx = hub_context()
    kind = "dataset" if repo_type == "dataset" else "model"
    mode = "offline (HF_HUB_OFFLINE=1): only the cache was searched" if ctx["HF_HUB_OFFLINE"] == "1" else (
        f"online (HF_HUB_OFFLINE=0): asked {ctx['endpoint']}, then the cache"
    )
    cli = f"hf download {repo_id}" + (" --repo-type dataset" if kind == "dataset" else "") + (
        f" --revision {revision}" if revision else ""
    )
    return (
        f"{key}: {value!r} is not a local path, so it was tried as a Hugging Face Hub {kind} id: "
        f"snapshot_download({repo_id!r}, repo_type={repo_type!r}, revision={revision or 'main'!r}) with the cache "
        f"{ctx['cache']} (HF_HOME={ctx['HF_HOME']}), {mode}; it failed: {type(error).__name__}: {_first_line(error)}. "
        f"To use a local copy instead: on a machine with access run `{cli} --local-dir DIR`, copy DIR here and set "
        f"{key}: DIR; or copy a Hugging Face cache holding it into $HF_HOME/hub and set HF_HUB_OFFLINE=1."
    )


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"

"""Hugging Face Hub ids as model locations: `org/name` -> a folder in huggingface_hub's cache.

The one place a `--model` value or a `kimik3.load` path is turned into a folder. An existing path wins; anything
shaped like a hub id (`org/name`, no such path) goes through `huggingface_hub.snapshot_download`, which downloads
when online and reads only its cache under `HF_HUB_OFFLINE=1` (the cache is `HF_HUB_CACHE`, as the hub lays it
out: models--org--name/snapshots/<commit>/ with refs/<revision> naming the commit).
"""

from __future__ import annotations

import re
from pathlib import Path

# what the hub accepts as a repo id: an owner and a name of letters, digits, '-', '_', '.'
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")


def is_hub_id(name: str | Path) -> bool:
    """`org/name` that is not an existing path (a relative folder of that name wins)."""
    s = str(name)
    return isinstance(name, str) and bool(_REPO_ID.match(s)) and not Path(s).exists() and ".." not in s


def resolve(name_or_path: str | Path, revision: str | None = None) -> Path:
    """The local folder of a model given as a path or a hub id (`revision`: branch, tag or commit; hub ids only).

    Raises:
        FileNotFoundError: neither an existing path nor an id the hub (or, offline, its cache) has; the message
            names the id, the revision and what to do.
        ValueError: `revision` given with a local path.
    """
    if not is_hub_id(name_or_path):
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to hub ids (org/name); {name_or_path} is a local path")
        return Path(name_or_path)
    try:
        import huggingface_hub
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:
        raise FileNotFoundError(f"{name_or_path}: no such folder; to read it as a Hugging Face Hub id install "
                                "huggingface-hub (pip install 'kimik3[hf]')") from None
    at = f" at revision {revision!r}" if revision else ""
    try:
        return Path(huggingface_hub.snapshot_download(str(name_or_path), revision=revision))
    except LocalEntryNotFoundError:
        raise FileNotFoundError(f"{name_or_path}: no such folder, and the Hugging Face Hub model {name_or_path}{at} "
                                "is not in the local cache (offline: HF_HUB_OFFLINE is set or the hub is "
                                "unreachable); download it once online, or pass a folder") from None
    except HfHubHTTPError as e:  # RepositoryNotFoundError, RevisionNotFoundError, gated repos
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise FileNotFoundError(f"{name_or_path}: no such folder, and the Hugging Face Hub could not give model "
                                f"{name_or_path}{at}: {first}") from None

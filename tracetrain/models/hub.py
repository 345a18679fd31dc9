"""A model named by a local directory or by a Hugging Face Hub id ("org/name"), as the directory
that holds its files.

    resolve_model_dir(path, revision, key)  a directory as given; an id: its snapshot in the
                                            Hugging Face cache, downloaded when online
    is_repo_id(value)                       "org/name" with the Hub's characters
    hub_cache() / hub_offline()             the cache directory and HF_HUB_OFFLINE, read from the
                                            environment when called (huggingface_hub reads
                                            them once, at its import)

Every place a config names a model (model.path, policies.<p>.model, `tracetrain eval/sft
--policy`, backend verl) resolves it here; what is served and trained is then that directory.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from tracetrain.config import ConfigError

REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def is_repo_id(value: str) -> bool:
    """`value` has the shape of a Hub model id: one "/" between an owner and a name."""
    if not REPO_ID.fullmatch(value):
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def hub_cache() -> Path:
    """The Hugging Face hub cache as the environment names it now: HF_HUB_CACHE, else
    HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub (default ~/.cache)."""
    env = os.environ
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        path = env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"]
    else:
        xdg = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        path = os.path.join(env.get("HF_HOME") or os.path.join(xdg, "huggingface"), "hub")
    return Path(os.path.expandvars(os.path.expanduser(path)))


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set to a true value now."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in ("1", "ON", "YES", "TRUE")


def resolve_model_dir(path: str, revision: str | None = None, key: str = "model.path", *,
                      allow_patterns: list[str] | None = None,
                      ignore_patterns: list[str] | None = None) -> str:
    """The local directory of the model `path` names: an existing directory, as given
    (`revision` unused); else a Hub id's snapshot at `revision` (a branch, tag or commit; None:
    main) from the cache (`hub_cache()`), downloaded first unless offline (`hub_offline()`);
    `allow_patterns` / `ignore_patterns` choose its files (huggingface_hub's globs). A value that
    is neither, an id missing from the cache offline, or one the Hub does not have: ConfigError
    naming `key` (a config key, or an option such as "--policy") and, for an id, the cache."""
    where = key if key.startswith("-") else f"config key {key!r}"
    if Path(path).expanduser().is_dir():
        return path
    if not is_repo_id(path):
        raise ConfigError(f"{where}: {path!r} is not a directory, nor a Hugging Face model id "
                          "('org/name')")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RevisionNotFoundError

    cache, offline = hub_cache(), hub_offline()
    at = "" if revision is None else f" at revision {revision!r}"
    try:
        return snapshot_download(path, revision=revision, cache_dir=cache, local_files_only=offline,
                                 allow_patterns=allow_patterns, ignore_patterns=ignore_patterns)
    except LocalEntryNotFoundError as e:
        why = ("HF_HUB_OFFLINE is set: download it online first (`hf download "
               f"{path}`)" if offline else f"the Hub could not be reached: {e}")
        raise ConfigError(f"{where}: {path!r}{at} is not a directory, nor a model in the Hugging "
                          f"Face cache {str(cache)!r} ({why})") from None
    except RevisionNotFoundError:
        raise ConfigError(f"{where}: the Hugging Face model {path!r} has no revision "
                          f"{revision!r}") from None
    except HfHubHTTPError as e:  # not on the Hub, gated, or private to another token
        raise ConfigError(f"{where}: {path!r} is not a directory, and the Hugging Face Hub "
                          f"refused it ({type(e).__name__}; cache {str(cache)!r})") from None

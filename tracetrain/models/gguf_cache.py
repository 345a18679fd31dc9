"""A GGUF checkpoint converted once: its dequantized model and its tokenizer saved as a transformers
directory in the cache, which later loads read instead of the GGUF file.

    key       = sha256(the file's resolved path, size and mtime; the versions of transformers,
                tokenizers and gguf; the source of the module that converts) [:16]
    directory = CACHE / "gguf" / f"{file stem}-{key}"     CACHE: $TRACETRAIN_CACHE, else
                                                          $XDG_CACHE_HOME/tracetrain, else
                                                          ~/.cache/tracetrain

A converted directory holds the model in fp32 (what the GGUF dequantizes to, so a cast to any dtype
afterwards is the cast the direct load makes) and the tokenizer exactly as the direct load builds
it. It is written beside its place and renamed into it, so a concurrent reader sees all of it or
none; a cache that cannot be written costs only the next load the conversion.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    """Where tracetrain keeps what it converts (module docstring)."""
    if os.environ.get("TRACETRAIN_CACHE"):
        return Path(os.environ["TRACETRAIN_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tracetrain"


def converted_dir(path: Path, converter_source: Path) -> Path:
    """The cache directory of GGUF file `path` (it may not exist yet): its key covers the file's
    identity, the libraries that read it and `converter_source`, the module that converts."""
    stat = path.resolve().stat()
    recipe = [str(path.resolve()), str(stat.st_size), str(stat.st_mtime_ns)]
    recipe += [importlib.metadata.version(d) for d in ("transformers", "tokenizers", "gguf")]
    recipe.append(hashlib.sha256(converter_source.read_bytes()).hexdigest())
    key = hashlib.sha256("\0".join(recipe).encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{path.stem}-{key}"


def _complete(target: Path) -> bool:
    """Whether a converted directory is in place (a rename puts it there whole)."""
    return (target / "config.json").is_file()


def cached(path: Path, converter_source: Path) -> Path | None:
    """The converted directory of GGUF file `path` where an earlier load made it, else None."""
    target = converted_dir(path, converter_source)
    return target if _complete(target) else None


def converted(path: Path, converter_source: Path, convert: Callable[[], tuple]) -> Path | None:
    """The converted directory of GGUF file `path`, made with `convert() -> (fp32 model,
    tokenizer)` when it is not in the cache yet; None when the cache cannot be written."""
    target = converted_dir(path, converter_source)
    if _complete(target):
        return target
    model, tokenizer = convert()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:  # another process put it there first: theirs is the same conversion
            shutil.rmtree(staging, ignore_errors=True)
    except OSError:
        return None
    return target

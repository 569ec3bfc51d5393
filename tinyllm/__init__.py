"""tinyllm: an LLM inference engine built step by step, from a KV cache to continuous batching."""

import os

# PyTorch's CPU threads spin while they wait for each other (OpenMP's default policy), which
# burns the cores of a busy or shared machine; waiting passively costs nothing on a quiet one.
# OpenMP reads the policy when torch is first imported, so it is set here, before: `python -m
# tinyllm ...` and a notebook that imports tinyllm first behave the same inside and outside make.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tinyllm.checkpoints.loading import load
from tinyllm.checkpoints.tokenizer import Tokenizer
from tinyllm.core.generate import generate, sample_next
from tinyllm.core.model import ModelConfig, Transformer

__all__ = ["load", "generate", "sample_next", "ModelConfig", "Transformer", "Tokenizer"]

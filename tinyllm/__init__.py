"""tinyllm: an LLM inference engine built step by step, from a KV cache to continuous batching."""

from tinyllm.loading import load
from tinyllm.generate import generate, sample_next
from tinyllm.model import ModelConfig, Transformer
from tinyllm.tokenizer import Tokenizer

__all__ = ["load", "generate", "sample_next", "ModelConfig", "Transformer", "Tokenizer"]

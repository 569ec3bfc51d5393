"""The checkpoints wing: weights and tokenizers in, a Transformer and a Tokenizer out.

Hugging Face directories (checkpoint.py), GGUF files (gguf_file.py), the one entry point
`tinyllm.load` (loading.py), the real model fetched once (smollm2.py), the tokenizer and its
chat template, and the script that trains the bundled model (train.py). The engine never
imports this wing; it only receives the model.
"""

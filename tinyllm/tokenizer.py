"""Step 00 - the tokenizer.

A thin wrapper over a `tokenizers` `tokenizer.json` (the file a Hugging Face model directory
ships), with the ids the engine needs: which token ends a text (eos) and which one starts it
(bos). The bundled model's tokenizer is a byte-level BPE of 2,048 tokens whose one special
token, `<|endoftext|>`, both starts a prompt and ends a speech; its post-processor puts it in
front of every encoded text.
"""

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    def __init__(self, tok: HFTokenizer, bos_id: int | None = None, eos_id: int | None = None):
        self.tok = tok
        self.bos_id = bos_id
        self.eos_id = eos_id

    @classmethod
    def from_file(cls, path: str | Path, bos_id: int | None = None,
                  eos_id: int | None = None) -> "Tokenizer":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: tokenizer file not found")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception on bad json
            raise ValueError(f"{path}: not a valid tokenizer.json ({e})") from None
        return cls(tok, bos_id, eos_id)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> token ids; the tokenizer's own post-processor adds bos when asked."""
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save(self, path: str | Path) -> None:
        self.tok.save(str(path))

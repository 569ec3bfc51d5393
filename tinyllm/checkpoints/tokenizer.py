"""Steps 00-09 - the tokenizer (00), and its chat template (09).

A thin wrapper over a `tokenizers` `tokenizer.json` (the file a Hugging Face model directory
ships), with the ids the engine needs: which token starts a text (bos) and which ones end it
(eos_ids: an instruct model may end a turn with any of several, Llama 3 with three; eos_id is the
first). The bundled model's tokenizer is a byte-level BPE of 2,048 tokens whose one special
token, `<|endoftext|>`, both starts a prompt and ends a speech; its post-processor puts it in
front of every encoded text. An instruct model's tokenizer also carries its chat template
(step 09), which turns a conversation into the prompt the model was tuned on.
"""

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    """Token ids in and out. bos_id: the id that starts a text (or None); eos_ids: every id that
    ends one, eos_id the first of them (None when there is none); chat_template: the Jinja
    source of the model's chat format, or None."""

    def __init__(self, tok: HFTokenizer, bos_id: int | None = None, eos_id: int | None = None,
                 eos_ids: tuple[int, ...] | list[int] | None = None,
                 chat_template: str | None = None):
        self.tok = tok
        self.bos_id = bos_id
        ids = ([eos_id] if eos_id is not None else []) + list(eos_ids or ())
        self.eos_ids = tuple(dict.fromkeys(ids))          # in order, without duplicates
        self.eos_id = self.eos_ids[0] if self.eos_ids else None
        self.chat_template = chat_template

    @classmethod
    def from_file(cls, path: str | Path, bos_id: int | None = None, eos_id: int | None = None,
                  eos_ids: tuple[int, ...] | list[int] | None = None,
                  chat_template: str | None = None) -> "Tokenizer":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: tokenizer file not found")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception on bad json
            raise ValueError(f"{path}: not a valid tokenizer.json ({e})") from None
        return cls(tok, bos_id, eos_id, eos_ids, chat_template)

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

    def id_to_token(self, i: int | None) -> str | None:
        """The token an id stands for ("<|im_end|>"); None for None."""
        return None if i is None else self.tok.id_to_token(i)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False, **kwargs) -> str | list[int]:
        """A conversation [{"role": "user", "content": "Hi"}, ...] -> the prompt text (or its ids
        with tokenize=True) in the model's chat format. The template writes every special token
        itself, so the text is encoded with add_special_tokens=False, as transformers does.
        kwargs reach the template as variables."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (a checkpoint ships one in "
                             "chat_template.jinja, tokenizer_config.json or a GGUF file's "
                             "tokenizer.chat_template); encode the prompt text instead")
        from tinyllm.checkpoints.chat_template import render  # step 09's, when asked

        text = render(self.chat_template, messages, add_generation_prompt,
                      bos_token=self.id_to_token(self.bos_id),
                      eos_token=self.id_to_token(self.eos_id), **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def save(self, path: str | Path) -> None:
        self.tok.save(str(path))

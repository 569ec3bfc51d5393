"""Step 09 - chat templates: a conversation becomes the one prompt an instruct model was tuned on.

An instruct model reads a conversation as text with markers around each turn (SmolLM2 opens
one with `<|im_start|>user` and closes it with `<|im_end|>`). Which markers, and where, is a
Jinja template the checkpoint ships: `chat_template.jinja`, the "chat_template" field of
`tokenizer_config.json`, or a GGUF file's `tokenizer.chat_template`. `render` runs it the way
transformers' `apply_chat_template` does, so a prompt is the same text whichever library builds
it: a sandboxed environment (a template is code from the internet), `trim_blocks` and
`lstrip_blocks`, `break` and `continue`, the helpers `raise_exception` and `strftime_now`, a
`tojson` that leaves non-ASCII and HTML characters as they are, `{% generation %}` blocks
rendered as plain text, and the variables bos_token, eos_token, tools and documents.
"""

import json
from datetime import datetime
from functools import lru_cache

from jinja2 import nodes
from jinja2.exceptions import TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def raise_exception(message: str):
    """What a template calls to refuse a conversation (e.g. roles that do not alternate)."""
    raise TemplateError(message)


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """json.dumps with the options templates pass; unlike Jinja's own, no HTML escaping."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def strftime_now(format: str) -> str:
    """Today's date in a template's format (Llama 3 writes it into the system prompt)."""
    return datetime.now().strftime(format)


class GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's text for training masks;
    a prompt renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


@lru_cache(maxsize=16)
def compile_template(source: str):
    """A template's source -> the compiled template (compiled once per source)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def render(source: str, messages: list[dict], add_generation_prompt: bool = True,
           bos_token: str | None = None, eos_token: str | None = None, **kwargs) -> str:
    """The conversation as the template writes it. messages: [{"role": ..., "content": ...}]
    (a key whose value is None counts as missing, as an OpenAI-style `"content": None` should);
    add_generation_prompt ends the text with the header of the assistant's turn, so the model
    answers next. kwargs reach the template as variables (and override bos_token and eos_token)."""
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
        raise TypeError(f"messages must be a list of dicts like {{'role': 'user', 'content': "
                        f"'Hi'}}, got {messages!r:.80}")
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    variables = dict(bos_token=bos_token, eos_token=eos_token, tools=None, documents=None)
    return compile_template(source).render(messages=messages,
                                           add_generation_prompt=add_generation_prompt,
                                           **{**variables, **kwargs})

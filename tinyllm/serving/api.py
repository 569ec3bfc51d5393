"""Step 10 - the API's request bodies, checked as the OpenAI API checks them.

A body's fields are of three kinds. Those the server reads (`FIELDS`): the prompt or messages,
max_tokens, the sampler's and the token stage's settings, n, logprobs, echo, vLLM's
prompt_logprobs, stop strings, stream and the constraint on the answer (12). Those OpenAI's or
vLLM's API define that it takes only at a value that changes nothing (`NO_OPS`: `tools: []`,
`best_of` equal to n, ...): any other value gets a 400 that names the field. Any other field
gets a 400 that names it; a value out of its range gets a 400 naming the field and the range
(OpenAI's, vLLM's, the engine's checks). `usage_of` reads a stream's stream_options.
`constraint_of` reads the one constraint a body asks for as the engine's `Constraint`, with the
field that asks it; `check_constraint` asks the grammar backend, and a refusal is a 400 naming
that field. A prompt too long to fit is refused by its size before it is tokenized;
`prompt_ids` tokenizes it and renders the chat template, off the server's event loop.
`to_request` turns a checked body into what it asks (`Asked`); the sampling fields it leaves out
take the model's defaults (`with_defaults`). Used by server.py.
"""

import json
import re
import reprlib
from dataclasses import dataclass, fields

from jinja2.exceptions import TemplateError

from tinyllm.core.requests import Request, check_token_stage
from tinyllm.core.sampling import Constraint, Sampling

COMPLETIONS, CHAT, TOKENIZE, DETOKENIZE = "completions", "chat", "tokenize", "detokenize"
GENERATE = {COMPLETIONS, CHAT}
NUMBER = (int, float)
MAX_BODY = 4 * 2**20  # bytes: a million characters of text, more than 128k tokens' worth


class APIError(Exception):
    """An error the client is told of, as the OpenAI API words it."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict:
        return {
            "error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}
        }


# the fields the server reads: name -> (the JSON types it takes, or {endpoint: types} where
# they differ, and the endpoints that read it)
FIELDS = {
    "model": (str, GENERATE | {TOKENIZE, DETOKENIZE}),
    "prompt": ((str, list), {COMPLETIONS, TOKENIZE}),
    "messages": (list, {CHAT, TOKENIZE}),
    "max_tokens": (int, GENERATE),
    "max_completion_tokens": (int, {CHAT}),
    "temperature": (NUMBER, GENERATE),
    "top_p": (NUMBER, GENERATE),
    "top_k": (int, GENERATE),
    "min_p": (NUMBER, GENERATE),
    "seed": (int, GENERATE),
    "n": (int, GENERATE),
    "best_of": (int, {COMPLETIONS}),  # equal to n, or not at all
    "presence_penalty": (NUMBER, GENERATE),
    "frequency_penalty": (NUMBER, GENERATE),
    "repetition_penalty": (NUMBER, GENERATE),
    "logit_bias": (dict, GENERATE),
    "stop": ((str, list), GENERATE),
    "stop_token_ids": (list, GENERATE),
    "min_tokens": (int, GENERATE),
    "ignore_eos": (bool, GENERATE),
    "logprobs": ({COMPLETIONS: int, CHAT: bool}, GENERATE),
    "top_logprobs": (int, {CHAT}),
    "prompt_logprobs": (int, GENERATE),
    "echo": (bool, {COMPLETIONS}),
    "stream": (bool, GENERATE),
    "stream_options": (dict, GENERATE),
    "add_special_tokens": (bool, GENERATE | {TOKENIZE}),
    "add_generation_prompt": (bool, {CHAT, TOKENIZE}),
    "return_token_strs": (bool, {TOKENIZE}),
    "tokens": (list, {DETOKENIZE}),
    # structured output (12): OpenAI's response_format, vLLM's structured_outputs, and its
    # legacy guided_* fields (constraint_of reads them)
    "response_format": (dict, GENERATE),
    "structured_outputs": (dict, GENERATE),
    "guided_json": ((dict, str), GENERATE),
    "guided_regex": (str, GENERATE),
    "guided_choice": (list, GENERATE),
    "guided_grammar": (str, GENERATE),
}
REQUIRED = {COMPLETIONS: "prompt", CHAT: "messages", DETOKENIZE: "tokens"}

# the fields taken only where they change nothing: name -> (the endpoints that know it, the
# values that change nothing (null always does), or a type whose every value changes nothing,
# and what another value would ask for)
CHAT_T = {CHAT, TOKENIZE}
GRAMMAR_BACKENDS = ("auto", "guidance", "llguidance")  # vLLM's names for this server's one
NO_OPS = {
    # OpenAI's, both endpoints
    "echo": ({CHAT}, (False,), "the last message echoed"),
    "user": (GENERATE, str, ""),
    # OpenAI's, completions
    "suffix": ({COMPLETIONS}, ("",), "a suffix to fill in before"),
    # OpenAI's, chat
    "tools": (CHAT_T, ([],), "tool calls"),
    "tool_choice": ({CHAT}, ("none", "auto"), "tool calls"),
    "parallel_tool_calls": ({CHAT}, bool, ""),  # without tools, either way
    "functions": ({CHAT}, ([],), "function calls"),
    "function_call": ({CHAT}, ("none", "auto"), "function calls"),
    "modalities": ({CHAT}, (["text"],), "audio output"),
    "audio": ({CHAT}, (), "audio output"),
    "prediction": ({CHAT}, (), "a predicted output"),
    "reasoning_effort": ({CHAT}, (), "a reasoning effort"),
    "verbosity": ({CHAT}, (), "a verbosity"),
    "web_search_options": ({CHAT}, (), "web search"),
    "store": ({CHAT}, (False,), "stored completions"),
    "metadata": ({CHAT}, dict, ""),
    "service_tier": ({CHAT}, str, ""),
    "prompt_cache_key": ({CHAT}, str, ""),
    "safety_identifier": ({CHAT}, str, ""),
    # vLLM's sampling parameters
    "include_stop_str_in_output": (GENERATE, (False,), "the stop string in the answer"),
    "skip_special_tokens": (GENERATE, (True,), "special tokens in the answer's text"),
    "spaces_between_special_tokens": (GENERATE, (True,), "special tokens in the answer's text"),
    "use_beam_search": (GENERATE, (False,), "beam search"),
    "length_penalty": (GENERATE, (1.0,), "beam search"),
    "bad_words": (GENERATE, ([],), "bad words"),
    "allowed_token_ids": (GENERATE, (), "a set of allowed tokens"),
    "truncate_prompt_tokens": (GENERATE, (), "prompt truncation"),
    "logits_processors": (GENERATE, (), "logits processors"),
    # vLLM's other parameters
    "guided_decoding_backend": (GENERATE, GRAMMAR_BACKENDS, "another grammar backend"),
    "guided_whitespace_pattern": (GENERATE, (), "a whitespace pattern for JSON"),
    "priority": (GENERATE, (0,), "priority scheduling"),
    "request_id": (GENERATE, str, ""),
    "cache_salt": (GENERATE, (), "a salted prefix cache"),
    "kv_transfer_params": (GENERATE, (), "disaggregated serving"),
    "vllm_xargs": (GENERATE, ({},), "extension arguments"),
    "return_tokens_as_token_ids": (GENERATE, (False,), "token ids as logprobs' tokens"),
    "return_token_ids": (GENERATE, (False,), "token ids in the answer"),
    "prompt_embeds": ({COMPLETIONS}, (), "prompt embeddings"),
    "continue_final_message": (CHAT_T, (False,), "the last message continued"),
    "documents": (CHAT_T, (), "documents for the chat template"),
    "chat_template": (CHAT_T, (), "a chat template of the request's own"),
    "chat_template_kwargs": (CHAT_T, ({},), "arguments to the chat template"),
    "mm_processor_kwargs": (CHAT_T, ({},), "multimodal input"),
    "media_io_kwargs": (CHAT_T, ({},), "multimodal input"),
    "include_reasoning": ({CHAT}, (True,), "reasoning left out of the answer"),
}
# stream_options' keys, as NO_OPS has them: include_usage and continuous_usage_stats are read
# (usage_of), include_obfuscation is taken either way
STREAM_OPTIONS = {
    "include_usage": bool,
    "continuous_usage_stats": bool,
    "include_obfuscation": bool,
}
# the keys a chat message may hold besides role, content and name, where they change nothing
MESSAGE_NO_OPS = {"tool_calls": ([],), "function_call": (), "refusal": (), "audio": ()}


SHORT = reprlib.Repr()  # a short repr: two levels deep, strings cut at 40
SHORT.maxlevel, SHORT.maxstring, SHORT.maxother = 2, 40, 40


def shown(value) -> str:
    """A value as an error message quotes it: JSON for a scalar, a short repr for the rest."""
    if isinstance(value, str) and len(value) > 40:
        value = value[:40] + "..."
    if value is None or isinstance(value, (bool, int, float, str)):
        return json.dumps(value)
    return SHORT.repr(value)


def same(value, noop) -> bool:
    """value is noop as JSON means it: 1 and 1.0 alike, true never 1."""
    return isinstance(value, bool) == isinstance(noop, bool) and value == noop


def changes_nothing(value, noop) -> bool:
    """value is null, one of the values of noop (a tuple), or of its type (noop a type)."""
    if value is None:
        return True
    if isinstance(noop, type):
        return isinstance(value, noop) and (noop is bool or not isinstance(value, bool))
    return any(same(value, v) for v in noop)


def check_no_op(name: str, value, noop, what: str) -> None:
    """A 400 naming the field unless its value changes nothing."""
    if changes_nothing(value, noop):
        return
    if isinstance(noop, type):
        raise APIError(400, f"{name} has the wrong type: {type(value).__name__}", name)
    takes = " or ".join([shown(v) for v in noop] + ["null"])
    raise APIError(
        400,
        f"{name}={shown(value)} is not supported ({what}): this server takes only {takes}",
        name,
    )


def check_field(name: str, value, kind: str) -> None:
    """A 400 naming the field when this endpoint does not know it, or its value is not one it
    takes: of its type, if the server reads it; else one that changes nothing."""
    if name in FIELDS and kind in FIELDS[name][1]:
        types = FIELDS[name][0]
        types = types[kind] if isinstance(types, dict) else types
        if value is not None and (
            not isinstance(value, types) or (isinstance(value, bool) and types is not bool)
        ):
            raise APIError(400, f"{name} has the wrong type: {type(value).__name__}", name)
    elif name in NO_OPS and kind in NO_OPS[name][0]:
        _, noop, what = NO_OPS[name]
        check_no_op(name, value, noop, what)
    else:
        reads = sorted(n for n, (_, endpoints) in FIELDS.items() if kind in endpoints)
        raise APIError(
            400,
            f"unknown field {name!r}: this server reads {', '.join(reads)}, and "
            f"takes OpenAI's and vLLM's other fields where they change nothing",
            name,
        )


def check_stream_options(body: dict) -> None:
    """stream_options, given only with stream: true (as vLLM says), each key one it takes."""
    options = body.get("stream_options")
    if options and not body.get("stream"):
        raise APIError(400, "stream_options can only be given with stream: true", "stream_options")
    for key, value in (options or {}).items():
        if key not in STREAM_OPTIONS:
            raise APIError(
                400,
                f"unknown field 'stream_options.{key}': this server takes "
                f"{', '.join(STREAM_OPTIONS)}",
                "stream_options",
            )
        check_no_op(f"stream_options.{key}", value, STREAM_OPTIONS[key], "usage in every chunk")


def usage_of(body: dict) -> tuple[bool, bool]:
    """(whether a stream ends with a chunk of its usage, whether every chunk carries the usage
    so far): stream_options' include_usage, and its continuous_usage_stats, which counts only
    with include_usage (as vLLM reads them)."""
    options = body.get("stream_options") or {}
    final = bool(options.get("include_usage"))
    return final, final and bool(options.get("continuous_usage_stats"))


def check_body(body, kind: str) -> dict:
    """The request body as a dict, every field known to the endpoint `kind` ("completions",
    "chat", "tokenize", "detokenize") and taken at its value; raises APIError(400) naming the
    field otherwise."""
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    for name, value in body.items():
        check_field(name, value, kind)
    need = REQUIRED.get(kind)
    if need is not None and body.get(need) is None:
        raise APIError(400, f"{need} is required", need)
    check_stream_options(body)
    return body


def check_model(body: dict, name: str) -> None:
    """A 404 when the body names a model this server does not serve."""
    if body.get("model") not in (None, name):
        raise APIError(
            404,
            f"the model {body['model']!r} does not exist: this server serves {name!r}",
            "model",
            "not_found_error",
        )


def parse_json(data: bytes):
    """A body's JSON; a 400 when it is not JSON, or nests too deep for the parser."""
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(
            400,
            "the body is nested too deep: its arrays and objects lie within "
            "each other deeper than the JSON parser goes",
        ) from None


# ---- the prompt: its size, its text, its tokens ------------------------------------------------
def longest_token_chars(tok) -> int:
    """The most characters one token of tok stands for. A vocabulary entry spells its token in
    at least as many characters as the text it covers (a byte-level BPE spells each byte as
    one; `<0x41>` stands for one byte), so its longest entry bounds every token's text."""
    return max(map(len, tok.tok.get_vocab(with_added_tokens=True)))


def encode(tok, text: str, add_special_tokens: bool) -> list[int]:
    """tok.encode(text), through encode_batch: the tokenizers library lets go of Python's lock
    while it encodes a batch, though not while it encodes one text, so the event loop runs on
    while a long prompt is tokenized in a thread."""
    return tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]


def check_size(n_chars: int, param: str, limit: tuple[int, int] | None) -> None:
    """A 400 naming param when a text of n_chars characters cannot fit; limit is (the positions
    a request may use, the tokenizer's longest token in characters), or None for no bound."""
    if limit is not None and n_chars > limit[0] * limit[1]:
        raise APIError(
            400,
            f"{param} is {n_chars:,} characters long: it cannot fit in this "
            f"model's {limit[0]} positions, since no token of its tokenizer "
            f"is longer than {limit[1]} characters",
            param,
        )


def checked_text(text: str, param: str) -> str:
    """text, if it is Unicode text; a 400 naming param when it holds a lone UTF-16 surrogate
    (JSON's `\\ud800`, valid JSON, is no character: no tokenizer takes it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(
            400,
            f"{param} holds a lone UTF-16 surrogate ({text[e.start]!r} at "
            f"character {e.start}), which is no Unicode text",
            param,
        ) from None
    return text


def check_token_ids(ids: list, param: str, vocab_size: int) -> None:
    """A 400 naming param unless every id is a token id of the vocabulary."""
    for j, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise APIError(
                400, f"{param}[{j}] is {shown(t)}, which is no token id in [0, {vocab_size})", param
            )


def content_text(content, param: str) -> str:
    """A message's content as text: a string, or a list of text parts
    ({"type": "text", "text": ...}) joined with newlines, as vLLM joins them."""
    if isinstance(content, str):
        return checked_text(content, param)
    if not isinstance(content, list):
        raise APIError(400, f"{param} must be a string or a list of text parts", param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise APIError(
                400,
                f"{param}[{j}] is a {shown(kind)} part: this server takes text "
                f"parts only ({{'type': 'text', 'text': ...}})",
                param,
            )
        if set(part) - {"type", "text"} or not isinstance(part.get("text"), str):
            raise APIError(400, f"{param}[{j}] must be {{'type': 'text', 'text': a string}}", param)
        texts.append(checked_text(part["text"], param))
    return "\n".join(texts)


def chat_messages(messages: list) -> list[dict]:
    """The conversation as the chat template takes it: each message {"role", "content"} (and
    its "name"), its content one string; a 400 naming the message or its field otherwise."""
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(
                400,
                f"{where} must be {{'role': a string, 'content': a string or a "
                f"list of text parts}}",
                where,
            )
        for key, value in m.items():
            if key not in ("role", "content", "name"):
                if key not in MESSAGE_NO_OPS:
                    raise APIError(400, f"unknown field {where}.{key}", f"{where}.{key}")
                check_no_op(f"{where}.{key}", value, MESSAGE_NO_OPS[key], "tool calls")
        message = {
            "role": checked_text(m["role"], f"{where}.role"),
            "content": content_text(m.get("content"), f"{where}.content"),
        }
        if m.get("name") is not None:
            if not isinstance(m["name"], str):
                raise APIError(400, f"{where}.name must be a string", f"{where}.name")
            message["name"] = checked_text(m["name"], f"{where}.name")
        out.append(message)
    return out


def chat_prompt(
    tok, messages: list[dict], add_generation_prompt: bool = True, add_special_tokens: bool = False
) -> list[int]:
    """A conversation's prompt: rendered with the model's chat template (the bundled model's:
    each message a speech, its role the speaker), then encoded; the template writes its own
    special tokens, so none are added unless asked."""
    if tok.chat_template is None:
        raise APIError(
            400, "this model has no chat template: send a prompt to /v1/completions", "messages"
        )
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except TemplateError as e:
        raise APIError(400, f"the chat template refused the messages: {e}", "messages") from None
    return encode(tok, text, add_special_tokens)


def completion_ids(
    tok, prompt, add_special_tokens: bool, limit: tuple[int, int] | None
) -> list[int]:
    """A completion's prompt as token ids: a string (refused by its size, then encoded), token
    ids, or a list of one of those."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, str):
        check_size(len(prompt), "prompt", limit)
        return encode(tok, checked_text(prompt, "prompt"), add_special_tokens)
    if all(isinstance(t, int) for t in prompt):
        check_token_ids(prompt, "prompt", tok.vocab_size)
        return list(prompt)
    raise APIError(
        400, "prompt must be a string or a list of token ids (one prompt a request)", "prompt"
    )


def prompt_ids(tok, body: dict, kind: str, limit: tuple[int, int] | None) -> list[int]:
    """The token ids of a checked body's prompt (kind "completions") or messages ("chat"),
    refused by size before any tokenizing when limit, (max_len, longest token in characters),
    says it cannot fit. Slow for a long prompt: call it off the event loop."""
    if kind == COMPLETIONS:
        return completion_ids(
            tok, body["prompt"], body.get("add_special_tokens") is not False, limit
        )
    messages = chat_messages(body["messages"])
    check_size(sum(len(m["content"]) for m in messages), "messages", limit)
    return chat_prompt(
        tok,
        messages,
        body.get("add_generation_prompt") is not False,
        bool(body.get("add_special_tokens")),
    )


# ---- structured output: the constraint a body asks (12) -----------------------------------------
CONSTRAINT_FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
VLLM_KINDS = ("json", "regex", "choice", "grammar", "json_object")  # vLLM's constraints
# structured_outputs' other keys, as NO_OPS has them: where they change nothing
STRUCTURED_NO_OPS = {
    "disable_any_whitespace": (bool, ""),  # this backend writes JSON compactly either way
    "disable_fallback": (bool, ""),  # one backend: nothing to fall back to
    "disable_additional_properties": ((False,), "additionalProperties: false added to a schema"),
    "whitespace_pattern": ((), "a whitespace pattern for JSON"),
    "structural_tag": ((), "structural tags"),
}
SCHEMA_KEYS = {"name": str, "description": str, "strict": bool, "schema": dict}
SPELLED = {
    "json_schema": "JSON schema",
    "json_object": "JSON object",
    "regex": "regular expression",
    "lark": "grammar",
}


def constraint_of(body: dict) -> tuple[str, Constraint] | None:
    """The constraint a checked body asks for, with the field that asks it (response_format,
    structured_outputs or one of vLLM's guided_*), or None; a 400 naming the field when its
    value is no constraint this server reads, or when two fields ask for one."""
    asked = []
    for name in CONSTRAINT_FIELDS:
        if body.get(name) is not None and (c := constraint_in(name, body[name])) is not None:
            asked.append((name, c))
    if len(asked) > 1:
        (first, _), (second, _) = asked[:2]
        raise APIError(
            400,
            f"{first} and {second} each ask for a constraint on the answer: a request takes one",
            second,
        )
    return asked[0] if asked else None


def constraint_in(name: str, value) -> Constraint | None:
    """The constraint one field asks for (its type checked already), or None."""
    if name == "response_format":
        return response_format_constraint(value)
    if name == "structured_outputs":
        return structured_outputs_constraint(value)
    return vllm_constraint(name.removeprefix("guided_"), value, name)


def response_format_constraint(value: dict) -> Constraint | None:
    """OpenAI's response_format: {"type": "text"} (none), {"type": "json_object"} (any JSON
    object) or {"type": "json_schema", "json_schema": {"name", "schema", "strict",
    "description"}} (its schema; the name, which OpenAI asks for, may be left out)."""
    param, kind = "response_format", value.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise APIError(
            400,
            f"response_format.type={shown(kind)} is not supported: this server takes "
            f'"text", "json_object" or "json_schema"',
            param,
        )
    if extra := sorted(set(value) - {"type", *(("json_schema",) if kind == "json_schema" else ())}):
        raise APIError(
            400, f"unknown field 'response_format.{extra[0]}' (of type {shown(kind)})", param
        )
    if kind != "json_schema":
        return None if kind == "text" else Constraint("json_object")
    spec = value.get("json_schema")
    if spec is None or isinstance(spec, dict) and spec.get("schema") is None:
        raise APIError(
            400,
            'response_format.json_schema.schema is required: {"type": "json_schema", '
            '"json_schema": {"name": ..., "schema": a JSON schema, "strict": ...}}',
            param,
        )
    if not isinstance(spec, dict):
        raise APIError(
            400, f"response_format.json_schema has the wrong type: {type(spec).__name__}", param
        )
    for key, v in spec.items():
        if key not in SCHEMA_KEYS:
            raise APIError(400, f"unknown field 'response_format.json_schema.{key}'", param)
        if v is not None and not isinstance(v, SCHEMA_KEYS[key]):
            raise APIError(400, f"response_format.json_schema.{key} has the wrong type", param)
    return json_schema_constraint(spec["schema"], param)


def structured_outputs_constraint(value: dict) -> Constraint | None:
    """vLLM's structured_outputs: at most one of json (a schema), regex, choice, grammar and
    json_object, with options where they change nothing (STRUCTURED_NO_OPS)."""
    for key, v in value.items():
        if key in STRUCTURED_NO_OPS:
            check_no_op(f"structured_outputs.{key}", v, *STRUCTURED_NO_OPS[key])
        elif key not in VLLM_KINDS:
            raise APIError(
                400,
                f"unknown field 'structured_outputs.{key}': this server reads "
                f"{', '.join(VLLM_KINDS)}",
                "structured_outputs",
            )
    kinds = [k for k in VLLM_KINDS if value.get(k) is not None and value[k] is not False]
    if len(kinds) > 1:
        raise APIError(
            400,
            f"structured_outputs asks for {' and '.join(kinds)}: a request takes one constraint",
            "structured_outputs",
        )
    return vllm_constraint(kinds[0], value[kinds[0]], "structured_outputs") if kinds else None


def vllm_constraint(key: str, value, param: str) -> Constraint | None:
    """One of vLLM's constraints, asked by param: json (a schema, or its JSON text), regex,
    choice (a list of strings: the answer is one of them), grammar (Lark, or llama.cpp's GBNF)
    or json_object (true: any JSON object)."""
    if key == "json":
        return json_schema_constraint(value, param)
    if key == "json_object":
        if not isinstance(value, bool):
            raise APIError(400, f"{param}.json_object must be true or false", param)
        return Constraint("json_object") if value else None
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise APIError(400, f"{param}: a choice is a non-empty list of strings", param)
        return Constraint("lark", choice_grammar([checked_text(c, param) for c in value]))
    if not isinstance(value, str):
        raise APIError(400, f"{param}: a {key} is a string, got {type(value).__name__}", param)
    if key == "regex":
        return Constraint("regex", checked_text(value, param))
    return Constraint("lark", lark_of(checked_text(value, param), param))


def json_schema_constraint(schema, param: str) -> Constraint:
    """A JSON schema (an object, or its JSON text) as a Constraint, its keys in the client's
    order: the answer's properties come in it, as OpenAI's do."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (json.JSONDecodeError, RecursionError) as e:
            raise APIError(400, f"{param} is not valid JSON: {e}", param) from None
    if not isinstance(schema, dict):
        raise APIError(400, f"{param}: a JSON schema is an object, got {shown(schema)}", param)
    try:
        return Constraint("json_schema", json.dumps(schema))
    except RecursionError:
        raise APIError(400, f"{param}: the schema is nested too deep", param) from None


def choice_grammar(choices: list[str]) -> str:
    """The Lark grammar whose sentences are exactly these strings (each a JSON-quoted literal,
    as llguidance writes a choice)."""
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def lark_of(grammar: str, param: str) -> str:
    """A grammar as Lark: as it is, or converted from GBNF (llama.cpp's `root ::= ...`, which
    vLLM's other backends take) by llguidance's converter."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(grammar)
    except Exception as e:  # the converter's own error says where
        raise APIError(400, f"{param}: the grammar is neither Lark nor GBNF: {e}", param) from None


# bytes of a constraint's text (Constraint.spec) at most: the engine compiles a constraint again
# as its request is added, its steps waiting meanwhile, so the largest taken must compile in
# about a CPU-second. LLGuidance.check on the bundled tokenizer, a Xeon core: a JSON schema of
# 490 properties, each a pattern (the costliest per byte measured), 0.86 s at 32 KiB, 1.7 s at
# 64 KiB; a choice of 3,700 strings 0.03 s; a regex of 2,100 alternatives 0.02 s
MAX_CONSTRAINT = 32 * 2**10


def check_constraint(grammars, param: str, constraint: Constraint, why: str | None = None) -> None:
    """A 400 naming param when there is no grammar backend, or the constraint is refused: its
    text is over MAX_CONSTRAINT bytes (the backend is not asked), or why says why (the
    backend's sentence, asked elsewhere: the server asks it in a process of its own, checks.py;
    or its CPU budget's), else the backend's own sentence, asked here. The backend compiles the
    grammar and walks its first tokens: a big one takes CPU-seconds."""
    if grammars is None:
        raise APIError(
            400, f"{param} is not supported: this server's engine has no grammar backend", param
        )
    if (size := len(constraint.spec.encode(errors="surrogatepass"))) > MAX_CONSTRAINT:
        why = f"it is {size:,} bytes, over the {MAX_CONSTRAINT:,} this server compiles"
    elif why is None:
        why = grammars.check(constraint)
    if why is not None:
        raise APIError(400, f"{param}: the {SPELLED[constraint.kind]} is refused: {why}", param)


# ---- the engine's request -----------------------------------------------------------------------
MAX_N = 128  # choices a request, at most (OpenAI's bound)
MAX_LOGPROBS = 20  # alternatives a token, at most (vLLM's default bound; OpenAI's is 5 or 20)
MAX_BIAS = 100  # a logit bias is in [-100, 100], as OpenAI has it


def count_in(body: dict, name: str, lo: int, hi: int) -> int | None:
    """body[name] (an int, checked by type already), or None; a 400 naming it outside [lo, hi]."""
    value = body.get(name)
    if value is not None and not lo <= value <= hi:
        raise APIError(400, f"{name} must be in [{lo}, {hi}], got {value}", name)
    return value


def logprobs_of(body: dict, kind: str) -> int | None:
    """The alternatives each answer token's logprobs list, or None for no logprobs: completions'
    `logprobs` (an int), chat's `top_logprobs` when `logprobs` is true (0 without it, as OpenAI
    refuses top_logprobs without logprobs)."""
    if kind == COMPLETIONS:
        return count_in(body, "logprobs", 0, MAX_LOGPROBS)
    top = count_in(body, "top_logprobs", 0, MAX_LOGPROBS)
    if not body.get("logprobs"):
        if top:
            raise APIError(
                400, "top_logprobs needs logprobs: true (as OpenAI has it)", "top_logprobs"
            )
        return None
    return top or 0


def logit_bias_of(body: dict) -> dict[int, float]:
    """logit_bias as {token id: bias}: its keys token ids as strings (JSON's keys are), its
    values numbers in [-100, 100]; the ids are checked against the vocabulary later."""
    out = {}
    for key, bias in (body.get("logit_bias") or {}).items():
        try:
            t = int(key)
        except ValueError:
            raise APIError(
                400, f"logit_bias has the key {shown(key)}, which is no token id", "logit_bias"
            ) from None
        if isinstance(bias, bool) or not isinstance(bias, NUMBER) or not abs(bias) <= MAX_BIAS:
            raise APIError(
                400,
                f"logit_bias[{shown(key)}] is {shown(bias)}: a bias is a number in "
                f"[-{MAX_BIAS}, {MAX_BIAS}]",
                "logit_bias",
            )
        out[t] = float(bias)
    return out


def sampler_of(body: dict) -> dict:
    """The sampler's settings (OpenAI's defaults: temperature 1, top_p 1; top_k 0 or -1 is
    none, as vLLM has it), as Sampling's keywords."""
    temperature, top_p = body.get("temperature"), body.get("top_p")
    temperature = 1.0 if temperature is None else float(temperature)
    if not 0 <= temperature <= 2:
        raise APIError(400, f"temperature must be in [0, 2], got {temperature}", "temperature")
    top_p = None if top_p is None or top_p == 1 else float(top_p)
    if top_p is not None and not 0 < top_p <= 1:
        raise APIError(400, f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = body.get("top_k")
    if top_k is not None and top_k < -1:
        raise APIError(400, f"top_k must be >= 1 (or 0 or -1 for none), got {top_k}", "top_k")
    top_k = top_k if top_k and top_k > 0 else None
    return dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=body.get("min_p") or 0.0)


def engine_error(e: ValueError, kind: str) -> APIError:
    """The engine's refusal of a setting as a 400 naming the body's field: its message starts
    with the setting's name (Sampling's, or check_token_stage's)."""
    names = sorted((f.name for f in fields(Sampling)), key=len, reverse=True)
    name = next((n for n in names if re.match(rf"{n}\b", str(e))), None)
    if kind == CHAT and name == "logprobs":
        name = "top_logprobs"
    return APIError(400, str(e), name)


PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")


def sampling_of(
    body: dict, kind: str, vocab_size: int, echo: bool = False, constraint: Constraint | None = None
) -> Sampling:
    """The body's Sampling: sampler, penalties, logit bias, stop token ids, min tokens, n
    choices (choice i seeded seed + i), logprobs (and the prompt's, for echo or vLLM's
    prompt_logprobs), the constraint (constraint_of's); its token ids checked against
    vocab_size. A 400 names a bad field."""
    n = count_in(body, "n", 1, MAX_N) or 1
    if body.get("best_of") not in (None, n):
        raise APIError(
            400,
            f"best_of={shown(body['best_of'])} is not supported (the best of several "
            f"answers): this server takes only best_of equal to n ({n}), or null",
            "best_of",
        )
    logprobs = logprobs_of(body, kind)
    prompt = count_in(body, "prompt_logprobs", 0, MAX_LOGPROBS)
    if prompt is not None and body.get("stream"):
        raise APIError(
            400, "prompt_logprobs are not given in a stream (as vLLM has it)", "prompt_logprobs"
        )
    if echo and logprobs is not None:  # the echoed prompt's logprobs come first
        prompt = max(prompt or 0, logprobs)
    penalties = {k: body[k] for k in PENALTIES if body.get(k) is not None}
    try:
        sampling = Sampling(
            **sampler_of(body),
            **penalties,
            seed=body.get("seed"),
            logit_bias=logit_bias_of(body),
            stop_token_ids=tuple(body.get("stop_token_ids") or ()),
            ignore_eos=bool(body.get("ignore_eos")),
            min_tokens=body.get("min_tokens") or 0,
            logprobs=logprobs,
            prompt_logprobs=prompt,
            n=n,
            constraint=constraint,
        )
        check_token_stage(sampling, vocab_size)
    except ValueError as e:
        raise engine_error(e, kind) from None
    return sampling


def stops_of(body: dict) -> list[str]:
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise APIError(
            400, "stop must be a string or a list of at most 4 non-empty strings", "stop"
        )
    return stops


def max_tokens_of(body: dict, kind: str, n_prompt: int, max_len: int) -> int:
    """The tokens to generate at most: max_completion_tokens (chat) or max_tokens, at least 1
    as OpenAI checks; when neither is given, OpenAI's defaults: 16, or all that fits (chat)."""
    name = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    n = body.get(name)
    if n is None:
        return 16 if kind == COMPLETIONS else max(1, max_len - n_prompt)
    if n < 1:
        raise APIError(400, f"{name} must be at least 1, got {n}", name)
    return n


@dataclass(frozen=True)
class Asked:
    """What a checked body asks: the engine's Request (its sampling's n choices, logprobs and
    prompt logprobs), the stop strings, the prompt's text to echo before each choice's
    (completions' echo; None: no echo), and the alternatives a token in vLLM's prompt_logprobs
    (None: none asked)."""

    request: Request
    stops: list[str]
    echo: str | None = None
    prompt_logprobs: int | None = None

    @property
    def plain(self) -> bool:
        """One choice, no logprobs, no echo: the stream sse_events writes."""
        s = self.request.sampling
        return s.n == 1 and s.logprobs is None and self.echo is None and s.prompt_logprobs is None


def with_defaults(body: dict, defaults: dict) -> dict:
    """The body with the model's sampling defaults (served.ModelDefaults' values) in the fields
    it leaves out, null leaving a field out as OpenAI's clients send it: a request's own fields
    always win."""
    return {**body, **{k: v for k, v in defaults.items() if body.get(k) is None}}


def to_request(
    body: dict,
    kind: str,
    ids: list[int],
    tok,
    max_len: int,
    vocab_size: int | None = None,
    constraint: Constraint | None = None,
    defaults: dict | None = None,
) -> Asked:
    """What a checked body whose prompt is ids asks (its token ids in settings checked against
    vocab_size, the tokenizer's by default), its answer under constraint (constraint_of's,
    checked by the grammar backend: check_constraint), the model's sampling defaults in the
    fields it leaves out."""
    body = with_defaults(body, defaults or {})
    param = "prompt" if kind == COMPLETIONS else "messages"
    if not ids:
        raise APIError(400, f"{param} is empty", param)
    max_tokens = max_tokens_of(body, kind, len(ids), max_len)
    if len(ids) + max_tokens > max_len:
        raise APIError(
            400,
            f"this model's maximum context length is {max_len} tokens; this "
            f"request asks for {len(ids) + max_tokens} ({len(ids)} in the "
            f"{param}, {max_tokens} to generate)",
            param,
        )
    if (body.get("min_tokens") or 0) > max_tokens:
        raise APIError(
            400,
            f"min_tokens ({body['min_tokens']}) is more than max_tokens ({max_tokens})",
            "min_tokens",
        )
    if constraint is not None and body.get("min_tokens"):
        raise APIError(
            400,
            "min_tokens is not supported with a constraint on the answer: its grammar says "
            "where the answer ends",
            "min_tokens",
        )
    echo = echo_text(body, ids, tok) if kind == COMPLETIONS and body.get("echo") else None
    sampling = sampling_of(body, kind, vocab_size or tok.vocab_size, echo is not None, constraint)
    request = Request(ids, max_tokens, eos_id=tok.eos_ids or None, sampling=sampling)
    return Asked(request, stops_of(body), echo, body.get("prompt_logprobs"))


def echo_text(body: dict, ids: list[int], tok) -> str:
    """The prompt as echoed: its text as sent, or its token ids' text."""
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else tok.decode(ids)

"""Step 09 - chat templates and end-of-turn ids: a conversation renders as transformers renders it,
a checkpoint directory's template and every EOS id are read by load, and save writes them back.
(SmolLM2's own template, from its GGUF file, is compared in test_gguf.py.)"""

import json
from datetime import datetime

import pytest
import torch
from jinja2.exceptions import TemplateError
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

import tinyllm
from tests.conftest import make_tiny
from tinyllm.checkpoints.checkpoint import DEFAULT, CheckpointError, save
from tinyllm.checkpoints.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

SPECIAL = [
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|im_start|>",
    "<|im_end|>",
]

CHATML = """{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}\
{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}\
{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}\
{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"""

LLAMA3 = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

ALTERNATING = """{% for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}
    {% endif %}
    {% if message['role'] == 'user' %}
        {{ '[INST] ' + message['content'] + ' [/INST]' }}
    {% else %}
        {{ message['content'] + eos_token }}
    {% endif %}
{% endfor %}"""

TOOLS = """{% set ns = namespace(turns=0) %}
{% if tools is not none %}{{ 'Tools: ' + tools | tojson(indent=2) + '\n' }}{% endif %}
{% for message in messages %}
    {% set ns.turns = ns.turns + 1 %}
    {% if message['content'] is not defined %}
        calls: {{ message['tool_calls'] | tojson }}
    {% elif message['role'] == 'assistant' %}
        {% generation %}{{ message['content'] | tojson }}{% endgeneration %}
    {% else %}
        {{ message['role'] }}: {{ message['content'] }}
    {% endif %}
    {% if ns.turns >= 3 %}{% break %}{% endif %}
{% endfor %}
turns={{ ns.turns }}"""

CHAT = [
    {"role": "system", "content": "  Be brief.  "},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": '4, écrit <b>quatre</b> & "vier"'},
    {"role": "user", "content": "And 3 + 3?"},
]


@pytest.fixture(scope="module")
def pair():
    """(tinyllm's Tokenizer, transformers' tokenizer) over the bundled vocabulary plus the
    special tokens the templates write; bos <|begin_of_text|>, eos <|eot_id|>."""
    tok = HFTokenizer.from_file(str(DEFAULT / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in SPECIAL])
    ids = {s: tok.token_to_id(s) for s in SPECIAL}
    ours = Tokenizer(tok, bos_id=ids["<|begin_of_text|>"], eos_ids=[ids["<|eot_id|>"]])
    theirs = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"
    )
    return ours, theirs


def render_both(pair, template, messages, **kwargs):
    ours, theirs = pair
    ours.chat_template = theirs.chat_template = template
    return (
        ours.apply_chat_template(messages, **kwargs),
        theirs.apply_chat_template(messages, tokenize=False, **kwargs),
    )


@pytest.mark.parametrize("template", [CHATML, LLAMA3, TOOLS], ids=["chatml", "llama3", "tools"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_as_transformers_does(pair, template, add_generation_prompt):
    """The same text, and with tokenize=True the same ids, as transformers' apply_chat_template,
    with tools and extra variables given or not."""
    tools = [{"name": "add", "description": "a + b, präzise"}]
    for messages, extra in ((CHAT, dict(tools=tools, date_string="26 Jul 2024")), (CHAT[1:2], {})):
        kwargs = dict(add_generation_prompt=add_generation_prompt, **extra)
        ours, theirs = render_both(pair, template, messages, **kwargs)
        assert ours == theirs, f"tinyllm:\n{ours!r}\ntransformers:\n{theirs!r}"
        ids = pair[0].apply_chat_template(messages, tokenize=True, **kwargs)
        want = pair[1].apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
        assert ids == want, f"tinyllm {ids} vs transformers {want}"


def test_llama3_template_writes_bos_and_todays_date(pair):
    """bos_token comes from the tokenizer's bos_id, strftime_now from the clock."""
    before = datetime.now().strftime("%d %b %Y")
    ours, _ = render_both(pair, LLAMA3, CHAT[1:2])
    after = datetime.now().strftime("%d %b %Y")
    assert ours.startswith("<|begin_of_text|><|start_header_id|>system")
    assert f"Today Date: {before}" in ours or f"Today Date: {after}" in ours
    ids = pair[0].apply_chat_template(CHAT[1:2], tokenize=True)
    assert ids[0] == pair[0].bos_id and ids.count(pair[0].bos_id) == 1


def test_raise_exception_refuses_as_transformers_does(pair):
    ours, theirs = render_both(pair, ALTERNATING, CHAT[1:], add_generation_prompt=False)
    assert ours == theirs and ours.count("<|eot_id|>") == 1
    for tokenizer in pair:
        with pytest.raises(TemplateError, match="roles must alternate"):
            tokenizer.apply_chat_template(CHAT[1:2] * 2, tokenize=False)


def test_a_none_value_counts_as_missing(pair):
    """An OpenAI-style assistant turn with "content": None renders as one without content."""
    messages = [
        CHAT[1],
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 2}}],
        },
    ]
    ours, theirs = render_both(pair, TOOLS, messages)
    assert ours == theirs and 'calls: [{"name": "add"' in ours


def test_no_template_is_a_clear_error():
    tok = Tokenizer.from_file(DEFAULT / "tokenizer.json", 0, 0)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(CHAT)


# ---- a checkpoint directory ---------------------------------------------------------------


@pytest.fixture
def ckpt(tmp_path):
    """A tiny saved checkpoint with the bundled tokenizer and no template."""
    tok = Tokenizer.from_file(DEFAULT / "tokenizer.json", 0, 0)
    save(make_tiny(vocab_size=2048, dtype=torch.float32), tok, tmp_path, dtype=torch.float32)
    return tmp_path


def edit_json(file, **fields):
    obj = json.loads(file.read_text()) if file.is_file() else {}
    file.write_text(json.dumps({**obj, **fields}))


def test_load_reads_the_template_of_a_directory(ckpt):
    """tokenizer_config.json's "chat_template" (a string or named templates), and
    chat_template.jinja before it, as transformers reads them."""
    assert tinyllm.load(ckpt, device="cpu")[1].chat_template is None
    edit_json(ckpt / "tokenizer_config.json", chat_template=CHATML)
    assert tinyllm.load(ckpt, device="cpu")[1].chat_template == CHATML
    edit_json(
        ckpt / "tokenizer_config.json",
        chat_template=[
            {"name": "tool_use", "template": TOOLS},
            {"name": "default", "template": LLAMA3},
        ],
    )
    assert tinyllm.load(ckpt, device="cpu")[1].chat_template == LLAMA3
    (ckpt / "chat_template.jinja").write_text(ALTERNATING)
    _, tok = tinyllm.load(ckpt, device="cpu")
    assert tok.chat_template == ALTERNATING
    assert tok.apply_chat_template(CHAT[1:2]).strip() == "[INST] What is 2 + 2? [/INST]"


def test_a_bad_template_field_is_named(ckpt):
    edit_json(ckpt / "tokenizer_config.json", chat_template=7)
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json: chat_template must be"):
        tinyllm.load(ckpt, device="cpu")


@pytest.mark.parametrize(
    "template, words",
    [
        (
            "{% for %}",
            r"tokenizer_config\.json: chat_template is not a valid Jinja template \(line 1: "
            r"Expected an expression",
        ),
        (
            "{{ messages | nosuchfilter }}",
            r"chat_template is not a valid Jinja template .*"
            r"No filter named 'nosuchfilter'",
        ),
        (
            [5],
            r"tokenizer_config\.json: chat_template\[0\] must be \{\"name\": \.\.\., "
            r"\"template\": \.\.\.\} with strings, got 5",
        ),
        ([{"name": "default"}], r"chat_template\[0\] must be .* got \{'name': 'default'\}"),
        (
            [{"name": "default", "template": "{{ x"}],
            r"tokenizer_config\.json: chat_template 'default' is not a valid Jinja template",
        ),
    ],
)
def test_a_broken_template_is_refused_at_load(ckpt, template, words):
    """A template that cannot compile, or named templates that are not {"name", "template"},
    fail at load with the file and the field, not at the first chat."""
    edit_json(ckpt / "tokenizer_config.json", chat_template=template)
    with pytest.raises(CheckpointError, match=words):
        tinyllm.load(ckpt, device="cpu")


@pytest.mark.parametrize(
    "data, words",
    [
        (b"{% for %}", r"chat_template\.jinja: not a valid Jinja template \(line 1: Expected"),
        (
            b"{% if x %}\nhi\n{% endfor %}",
            r"chat_template\.jinja: not a valid Jinja template "
            r"\(line 3: Encountered unknown tag 'endfor'",
        ),
        (b"\xff\xfe{{ messages }}", r"chat_template\.jinja: not UTF-8 text"),
    ],
)
def test_a_broken_template_file_is_refused_at_load(ckpt, data, words):
    (ckpt / "chat_template.jinja").write_bytes(data)
    with pytest.raises(CheckpointError, match=words):
        tinyllm.load(ckpt, device="cpu")


@pytest.mark.parametrize(
    "config_eos, generation_eos, want",
    [
        (1001, [1001, 1008, 1009], (1001, 1008, 1009)),  # as Llama 3.1 Instruct lists them
        ([2, 7], 7, (2, 7)),
        (5, None, (5,)),
        (None, [9, 4], (9, 4)),
    ],
)
def test_every_eos_id_is_collected_in_order(ckpt, config_eos, generation_eos, want):
    """config.json's eos_token_id then generation_config.json's, without duplicates; eos_id is
    the first."""
    edit_json(ckpt / "config.json", eos_token_id=config_eos)
    if generation_eos is not None:
        edit_json(ckpt / "generation_config.json", eos_token_id=generation_eos)
    _, tok = tinyllm.load(ckpt, device="cpu")
    assert tok.eos_ids == want and tok.eos_id == want[0]


def test_a_bad_generation_config_eos_is_named(ckpt):
    edit_json(ckpt / "generation_config.json", eos_token_id=["2"])
    with pytest.raises(CheckpointError, match=r"generation_config\.json: eos_token_id must be"):
        tinyllm.load(ckpt, device="cpu")
    edit_json(ckpt / "generation_config.json", eos_token_id=[2, 128009])
    with pytest.raises(
        CheckpointError,
        match=r"generation_config\.json: eos_token_id 128009 "
        r"is not a token of the model \(its vocab_size "
        r"is 2048\)",
    ):
        tinyllm.load(ckpt, device="cpu")

"""Step 10 - the model's sampling defaults, as vLLM's --generation-config applies them: the
fields a request leaves out take the checkpoint's values (a directory's generation_config.json,
a GGUF file's general.sampling.* keys), llama-server's where it states none, none with
--generation-config vllm; a request's own fields win, and /v1/models shows them."""

import json
import shutil

import gguf
import httpx
import pytest

from tests.test_server import NAME, PROMPTS, Running
from tinyllm.build import make_engine
from tinyllm.checkpoints.checkpoint import DEFAULT, CheckpointError
from tinyllm.checkpoints.loading import generation_defaults
from tinyllm.core.generate import solo
from tinyllm.core.requests import Request
from tinyllm.core.sampling import Sampling
from tinyllm.serving import launch, served

pytestmark = pytest.mark.slow  # servers, each with its engine process

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def solo_text(running, prompt: str, n: int, **sampling) -> str:
    """Solo generation's text for a completion of prompt with these Sampling settings."""
    tok = running.tok
    request = Request(tok.encode(prompt), n, tok.eos_ids, Sampling(**sampling))
    return tok.decode(solo(running.engine.model, request).tokens)


def checkpoint_with(tmp_path, generation_config: dict):
    """The bundled checkpoint in tmp_path, with this generation_config.json."""
    path = tmp_path / "model"
    shutil.copytree(DEFAULT, path)
    (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


def gguf_with(tmp_path, meta: dict):
    """A GGUF file of metadata alone: these general.sampling.* keys."""
    path = tmp_path / "sampling.gguf"
    w = gguf.GGUFWriter(path, "llama")
    for key, value in meta.items():
        (w.add_int32 if isinstance(value, int) else w.add_float32)(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_checkpoint_states_its_sampling_defaults(tmp_path):
    """generation_config.json's sampling fields where they differ from transformers' defaults
    (as vLLM reads them: top_k 50 and repetition_penalty 1.0 state nothing, do_sample is not
    read); a GGUF file's general.sampling.* keys (llama.cpp's, rounded from float32); none for
    the bundled model and SmolLM2's file; a value that is no number is refused by name."""
    stated = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 50}
    path = checkpoint_with(tmp_path, {**stated, "repetition_penalty": 1.0, "eos_token_id": 0})
    assert generation_defaults(path) == {"temperature": 0.6, "top_p": 0.9}
    keys = {"general.sampling.temp": 0.7, "general.sampling.top_k": 20}
    keys |= {"general.sampling.top_p": 0.95, "general.sampling.penalty_repeat": 1.1}
    assert generation_defaults(gguf_with(tmp_path, keys)) == {
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.95,
        "repetition_penalty": 1.1,
    }
    assert generation_defaults("default") == {}
    (path / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(CheckpointError, match="generation_config.json: temperature"):
        generation_defaults(path)


def test_serve_takes_the_checkpoints_defaults_else_llama_servers(tmp_path):
    """--generation-config auto (the default): the checkpoint's, else llama-server's
    (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05); vllm: none; a folder: its file's; a
    default out of its range is refused before anything is served."""
    assert launch.serve_parser().parse_args([]).generation_config == "auto"
    values, source = served.model_defaults("default")
    assert values == {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
    assert "llama-server" in source
    assert served.model_defaults("default", "vllm")[0] == {}
    path = checkpoint_with(tmp_path, {"temperature": 0.3, "min_p": 0.1})
    assert served.model_defaults(str(path)) == ({"temperature": 0.3, "min_p": 0.1}, "checkpoint")
    assert served.model_defaults("default", str(path))[0] == {"temperature": 0.3, "min_p": 0.1}
    with pytest.raises(ValueError, match="no generation_config.json"):
        served.model_defaults("default", str(tmp_path))
    (path / "generation_config.json").write_text(json.dumps({"temperature": 3.0}))
    with pytest.raises(ValueError, match=r"temperature must be in \[0, 2\]"):
        served.model_defaults(str(path))


@pytest.fixture(scope="module")
def greedy_by_default(bundled64):
    """A server whose model defaults to greedy and to a repetition penalty."""
    model, tok = bundled64
    defaults = {"temperature": 0.0, "repetition_penalty": 1.3}
    srv = Running(make_engine(model, 4), tok, defaults=(defaults, "checkpoint"))
    yield srv
    srv.stop()


def test_the_defaults_fill_only_the_fields_a_request_leaves_out(greedy_by_default):
    """A request without temperature or repetition_penalty gets the model's (greedy, penalized:
    solo generate's tokens with them); a request's own fields win (null is left out, as
    OpenAI's clients send it); /v1/models shows the defaults and where they come from."""
    srv, cl = greedy_by_default, greedy_by_default.client()
    r = cl.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=24)
    assert r.choices[0].text == solo_text(srv, PROMPTS[0], 24, repetition_penalty=1.3)
    body = {"prompt": PROMPTS[0], "max_tokens": 24, "temperature": None}
    plain = httpx.post(srv.url + "/completions", json={**body, "repetition_penalty": 1.0})
    assert plain.json()["choices"][0]["text"] == solo_text(srv, PROMPTS[0], 24)
    sampled = cl.completions.create(
        model=NAME, prompt=PROMPTS[1], max_tokens=24, temperature=1.0, seed=3
    )
    want = solo_text(srv, PROMPTS[1], 24, temperature=1.0, seed=3, repetition_penalty=1.3)
    assert sampled.choices[0].text == want
    model = httpx.get(srv.url + "/models").json()["data"][0]
    assert model["sampling_defaults"] == {"temperature": 0.0, "repetition_penalty": 1.3}
    assert model["sampling_defaults_from"] == "checkpoint"
    assert srv.wait_idle() == (0, 0)


def test_a_server_built_without_defaults_samples_as_openai_says(running_plain):
    """server.build with no defaults (what --generation-config vllm serves): temperature 1,
    nothing cut, as OpenAI's API defaults are; /v1/models says so."""
    srv = running_plain
    r = srv.client().completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=16, seed=9)
    assert r.choices[0].text == solo_text(srv, PROMPTS[2], 16, temperature=1.0, seed=9)
    model = httpx.get(srv.url + "/models").json()["data"][0]
    assert model["sampling_defaults"] == {} and model["sampling_defaults_from"] == "none"


@pytest.fixture(scope="module")
def running_plain(bundled64):
    model, tok = bundled64
    srv = Running(make_engine(model, 2), tok)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def smollm2(smollm2_file, smollm2_model):
    return smollm2_file, smollm2_model


def test_smollm2_is_served_with_llama_servers_defaults(smollm2):
    """SmolLM2-135M-Instruct's file states no sampling, so a question without temperature is
    sampled with llama-server's cuts: each seeded answer is solo's under them."""
    path, (model, tok) = smollm2
    defaults = served.model_defaults(str(path))
    assert defaults == (served.LLAMA_SERVER, "llama-server")
    srv = Running(make_engine(model, 3), tok, defaults=defaults)
    try:
        cl, ids = srv.client(), tok.apply_chat_template(QUESTION, tokenize=True)
        for seed in range(3):
            r = cl.chat.completions.create(model=NAME, messages=QUESTION, max_tokens=24, seed=seed)
            want = Sampling(seed=seed, **served.LLAMA_SERVER)
            answer = tok.decode(solo(model, Request(ids, 24, tok.eos_ids, want)).tokens)
            assert r.choices[0].message.content == answer, (seed, answer)
    finally:
        srv.stop()

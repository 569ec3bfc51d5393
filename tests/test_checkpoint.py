"""Step 00 - checkpoints: a Hugging Face Llama directory in and out, and every way it can be bad."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import tinyllm
from tests.conftest import make_tiny
from tinyllm.checkpoints.checkpoint import DEFAULT, CheckpointError, resolve, save
from tinyllm.checkpoints.tokenizer import Tokenizer
from tinyllm.checkpoints.train import train_tokenizer

TEXT = [
    "Ham.\nTo be, or not to be, that is the question.",
    "Oph.\nGood my lord, how does your honour for this many a day?",
] * 20


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(TEXT, 300)


@pytest.fixture
def ckpt(tmp_path, tokenizer):
    """A freshly saved tiny checkpoint (float32, untied head) in its own folder."""
    model = make_tiny(vocab_size=300, dtype=torch.float32)
    save(model, tokenizer, tmp_path / "ckpt", dtype=torch.float32)
    return tmp_path / "ckpt", model


def test_round_trip_same_logits(ckpt):
    path, model = ckpt
    loaded, tok = tinyllm.load(path, device="cpu")
    idx = torch.randint(0, 300, (2, 10))
    assert torch.equal(loaded(idx)[0], model(idx)[0])
    assert tok.eos_id == 0 and tok.encode("Ham.")[0] == 0


def test_round_trip_tied_bf16(tmp_path, tokenizer):
    """A tied head is written once; bf16 storage loads back as the bf16-rounded weights."""
    model = make_tiny(vocab_size=300, dtype=torch.float32, tie_embeddings=True)
    save(model, tokenizer, tmp_path, dtype=torch.bfloat16)
    names = load_file(tmp_path / "model.safetensors").keys()
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    loaded, _ = tinyllm.load(tmp_path, device="cpu")
    assert loaded.lm_head.weight is loaded.embed_tokens.weight
    want = model.layers[0].mlp.up_proj.weight.to(torch.bfloat16).float()
    assert torch.equal(loaded.layers[0].mlp.up_proj.weight, want)


def test_round_trip_keeps_every_eos_id_and_the_chat_template(tmp_path, tokenizer):
    """Several EOS ids are written as config.json's list; a template as chat_template.jinja."""
    tok = Tokenizer(tokenizer.tok, bos_id=0, eos_ids=[0, 5, 7], chat_template="{{ messages }}")
    save(make_tiny(vocab_size=300, dtype=torch.float32), tok, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["eos_token_id"] == [0, 5, 7]
    _, loaded = tinyllm.load(tmp_path, device="cpu")
    assert loaded.eos_ids == (0, 5, 7) and loaded.eos_id == 0
    assert loaded.chat_template == "{{ messages }}"


def test_config_uses_llama_field_names(ckpt):
    cfg = json.loads((ckpt[0] / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    for field in (
        "hidden_size",
        "num_hidden_layers",
        "num_key_value_heads",
        "intermediate_size",
        "max_position_embeddings",
        "rope_theta",
        "rms_norm_eps",
        "tie_word_embeddings",
    ):
        assert field in cfg


def expect_error(path, *words):
    with pytest.raises(CheckpointError) as e:
        tinyllm.load(path, device="cpu")
    for w in words:
        assert w in str(e.value), f"{w!r} not in: {e.value}"


def test_missing_files_are_named(ckpt):
    path, _ = ckpt
    expect_error(
        path.parent / "nowhere",
        "nowhere",
        "no such file or directory",
        "python -m tinyllm fetch smollm2",
    )
    (path.parent / "notes.txt").write_text("not a model")
    expect_error(path.parent / "notes.txt", "notes.txt", "not a checkpoint directory or .gguf file")
    (path / "model.safetensors").unlink()
    expect_error(path, "model.safetensors", "missing")
    (path / "config.json").unlink()
    expect_error(path, "config.json", "missing")


def test_missing_tokenizer_is_named(ckpt):
    (ckpt[0] / "tokenizer.json").unlink()
    expect_error(ckpt[0], "tokenizer.json: missing", "needs tokenizer.json")


@pytest.mark.parametrize("text", ["{ not json", "[]", '{"model": 5}'])
def test_bad_tokenizer_json_is_named(ckpt, text):
    """A tokenizer.json the tokenizers library cannot read is a CheckpointError naming it."""
    (ckpt[0] / "tokenizer.json").write_text(text)
    expect_error(ckpt[0], "tokenizer.json: not a valid tokenizer.json")


def test_corrupt_safetensors_is_named(ckpt):
    path, _ = ckpt
    (path / "model.safetensors").write_bytes(b"\x13\x00\x00\x00\x00\x00\x00\x00not json at all....")
    expect_error(path, "model.safetensors", "corrupt or truncated")


def test_truncated_safetensors_is_named(ckpt):
    path, _ = ckpt
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    expect_error(path, "model.safetensors", "corrupt or truncated")


def test_empty_safetensors_is_named(ckpt):
    (ckpt[0] / "model.safetensors").write_bytes(b"")
    expect_error(ckpt[0], "model.safetensors", "corrupt or truncated")


def test_bad_config_json_is_named(ckpt):
    (ckpt[0] / "config.json").write_text("{ not json")
    expect_error(ckpt[0], "config.json", "not valid JSON")


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(model_type="gpt2"), ["unsupported architecture", "gpt2"]),
        (dict(hidden_act="gelu"), ["unsupported hidden_act"]),
        (dict(mlp_bias=True), ["mlp_bias"]),
        (dict(model_type="qwen2", use_sliding_window=True), ["use_sliding_window"]),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), ["RoPE scaling", "yarn"]),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), ["llama3", "low_freq_factor"]),
        (dict(num_hidden_layers=None), ["num_hidden_layers"]),
    ],
)
def test_unsupported_config_is_named(ckpt, change, words):
    path, _ = ckpt
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(change)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (path / "config.json").write_text(json.dumps(cfg))
    expect_error(path, "config.json", *words)


def test_shape_mismatch_is_named(ckpt):
    path, _ = ckpt
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (path / "config.json").write_text(json.dumps(cfg))
    expect_error(path, "mlp", "has shape", "(160, 64)", "(128, 64)")


def test_missing_and_unexpected_tensors_are_named(ckpt, tmp_path):
    path, _ = ckpt
    tensors = load_file(path / "model.safetensors")
    good = dict(tensors)
    del tensors["model.norm.weight"]
    save_file(tensors, path / "model.safetensors")
    expect_error(path, "missing tensor", "model.norm.weight")
    good["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2)
    save_file(good, path / "model.safetensors")
    expect_error(path, "unexpected tensor", "model.layers.9")


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.float8_e4m3fn])
def test_weights_that_are_not_floats_are_named(ckpt, dtype):
    """A tensor stored as ints, bools or float8 is refused with its name and dtype."""
    path, _ = ckpt
    tensors = load_file(path / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(dtype)
    save_file(tensors, path / "model.safetensors")
    expect_error(
        path,
        "'model.norm.weight'",
        f"has dtype {str(dtype).removeprefix('torch.')}",
        "float32, float64, bfloat16, float16",
    )


def test_non_finite_weights_are_named(ckpt):
    path, _ = ckpt
    tensors = load_file(path / "model.safetensors")
    tensors["model.norm.weight"][3] = float("nan")
    save_file(tensors, path / "model.safetensors")
    expect_error(path, "model.norm.weight", "NaN")


def test_tokenizer_larger_than_vocab_is_named(tmp_path, tokenizer):
    save(make_tiny(vocab_size=97, dtype=torch.float32), tokenizer, tmp_path)
    expect_error(tmp_path, "tokenizer.json", "300 tokens")


def test_sharded_checkpoint_loads(ckpt):
    """Shards listed in model.safetensors.index.json load like one file (real checkpoints)."""
    path, model = ckpt
    tensors = load_file(path / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, path / file)
    (path / "model.safetensors").unlink()
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded, _ = tinyllm.load(path, device="cpu")
    idx = torch.randint(0, 300, (1, 6))
    assert torch.equal(loaded(idx)[0], model(idx)[0])
    (path / "b.safetensors").unlink()
    expect_error(path, "b.safetensors", "missing")


def test_default_is_the_bundled_checkpoint(bundled):
    model, tok = bundled
    assert model.cfg.vocab_size == tok.vocab_size == 2048
    assert next(model.parameters()).dtype == torch.float32


def test_weights_load_in_the_asked_dtype_without_a_float32_model(monkeypatch):
    """The model is built on the meta device (no storage) and each tensor goes straight to the
    asked dtype: no float32 copy of the weights on the way. Tied weights stay tied."""
    from tinyllm.checkpoints import checkpoint

    built_on = []

    class Watched(checkpoint.Transformer):
        def __init__(self, cfg):
            super().__init__(cfg)
            built_on.append({p.device.type for p in self.parameters()})

    monkeypatch.setattr(checkpoint, "Transformer", Watched)
    model, tok = tinyllm.load(device="cpu", dtype=torch.bfloat16)
    assert built_on == [{"meta"}]
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.rope_cos.device.type == "cpu" and model.rope_cos.dtype == torch.float32
    assert len(tinyllm.generate(model, tok.encode("Ham.\n"), 5)) == 5


def test_a_hub_id_needs_download_true():
    with pytest.raises(CheckpointError, match="download=True"):
        tinyllm.load("HuggingFaceTB/SmolLM2-135M", device="cpu")


def test_max_seq_len_caps_the_positions_served(tmp_path):
    model, _ = tinyllm.load(device="cpu", max_seq_len=128)
    assert model.cfg.max_seq_len == 128 and model.rope_cos.shape[0] == 128
    with pytest.raises(
        CheckpointError, match="exceeds the checkpoint's max_position_embeddings 512"
    ):
        tinyllm.load(device="cpu", max_seq_len=1024)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "128"])
def test_max_seq_len_must_be_a_positive_int(ckpt, bad):
    """0, a negative, a fraction, a bool or a string is refused, not read as the default."""
    with pytest.raises(ValueError, match=r"max_seq_len must be an int >= 1, got"):
        tinyllm.load(ckpt[0], device="cpu", max_seq_len=bad)


@pytest.mark.parametrize(
    "bad", [torch.int64, torch.bool, torch.complex64, torch.float8_e4m3fn, "float32", 5]
)
def test_dtype_must_be_a_float_dtype(bad):
    """A dtype other than float32, float64, bfloat16 or float16 is refused by name before any
    file is read (here the path does not even exist)."""
    with pytest.raises(
        ValueError,
        match=r"dtype must be one of torch\.float32, torch\.float64, "
        r"torch\.bfloat16, torch\.float16 or None",
    ) as e:
        tinyllm.load("nowhere", device="cpu", dtype=bad)
    assert f"got {bad!r}" in str(e.value)
    if isinstance(bad, str):
        assert "pass torch.float32" in str(e.value)


@pytest.mark.parametrize(
    "device, words",
    [
        ("gpu", r"device must be 'cpu', 'cuda', 'cuda:N' or None, got 'gpu'"),
        ("cuda:99", r"device 'cuda:99': this machine has"),
    ],
)
def test_device_must_be_one_torch_can_use(device, words):
    """A device torch does not know, or a GPU the machine does not have, is refused by name
    before any file is read."""
    with pytest.raises(ValueError, match=words):
        tinyllm.load("nowhere", device=device)


@pytest.mark.parametrize("bad", [5, None, ["default"]])
def test_path_must_be_a_str_or_path(bad):
    with pytest.raises(TypeError, match=r"path must be a str or a Path .*, got"):
        tinyllm.load(bad, device="cpu")


@pytest.mark.parametrize("text", ["[]", "null", '"llama"', "7"])
def test_config_json_must_hold_an_object(ckpt, text):
    """Valid JSON that is not an object is refused with the file's name."""
    (ckpt[0] / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=r"config\.json: must hold a JSON object, got"):
        tinyllm.load(ckpt[0], device="cpu")


@pytest.mark.parametrize(
    "index, words",
    [
        ([], r"index\.json: must hold a JSON object, got an array"),
        ({"weight_map": []}, r"index\.json: weight_map must map tensor names to file names"),
        (
            {"weight_map": {"model.norm.weight": 3}},
            r"index\.json: weight_map must map tensor names",
        ),
    ],
)
def test_bad_safetensors_index_is_named(ckpt, index, words):
    """An index that is not {"weight_map": {name: file}} is refused with the file's name."""
    (ckpt[0] / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=words):
        tinyllm.load(ckpt[0], device="cpu")


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(hidden_size="64"), r"hidden_size must be an int >= 1, got '64'"),
        (dict(num_attention_heads=0), r"num_attention_heads must be an int >= 1, got 0"),
        (dict(vocab_size=None), r"vocab_size must be an int >= 1, got None"),
        (dict(head_dim=16.0), r"head_dim must be an int >= 1, got 16\.0"),
        (dict(rms_norm_eps="1e-5"), r"rms_norm_eps must be a number > 0, got '1e-5'"),
        (dict(rope_theta=-1), r"rope_theta must be a number > 0, got -1"),
        (dict(rope_scaling="llama3"), r"rope_scaling must be a JSON object, got 'llama3'"),
        (dict(model_type=["llama"]), r"unsupported architecture model_type=\['llama'\]"),
        (
            dict(eos_token_id=[]),
            r"eos_token_id must be a token id \(an int >= 0\) or a non-empty "
            r"list of them, got \[\]",
        ),
        (dict(eos_token_id=[2, "3"]), r"eos_token_id must be a token id .*, got \[2, '3'\]"),
        (dict(bos_token_id="0"), r"bos_token_id must be a token id \(an int >= 0\), got '0'"),
        (
            dict(bos_token_id=300),
            r"bos_token_id 300 is not a token of the model \(its vocab_size "
            r"is 300\)",
        ),
        (dict(eos_token_id=[0, 5000]), r"eos_token_id 5000 is not a token of the model"),
        (
            dict(tie_word_embeddings="false"),
            r"tie_word_embeddings must be true or false, got 'false'",
        ),
        (dict(attention_bias="false"), r"attention_bias must be true or false, got 'false'"),
        (dict(mlp_bias="false"), r"mlp_bias must be true or false, got 'false'"),
        (
            dict(num_key_value_heads=3),
            r"num_attention_heads 4 is not a multiple of "
            r"num_key_value_heads 3",
        ),
        (dict(head_dim=15), r"head_dim 15 is odd"),
        (
            dict(rope_theta=None, rope_parameters={"rope_type": "default", "rope_theta": "1e4"}),
            r"rope_parameters' rope_theta must be a number > 0, got '1e4'",
        ),
        (
            dict(rope_scaling={**LLAMA3, "factor": "8"}),
            r"llama3 RoPE scaling's factor must be a number > 0, got '8'",
        ),
        (
            dict(rope_scaling={**LLAMA3, "original_max_position_embeddings": -1}),
            r"llama3 RoPE scaling's original_max_position_embeddings must be a number > 0, got -1",
        ),
        (
            dict(rope_scaling={**LLAMA3, "low_freq_factor": 4.0}),
            r"llama3 RoPE scaling's low_freq_factor 4\.0 must be below its high_freq_factor 4\.0",
        ),
    ],
)
def test_config_value_of_wrong_type_is_named(ckpt, change, words):
    """A config.json value of the wrong type or range is refused with its field and value."""
    cfg = json.loads((ckpt[0] / "config.json").read_text())
    cfg.update(change)
    (ckpt[0] / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: " + words):
        tinyllm.load(ckpt[0], device="cpu")


def test_the_command_line_names_a_missing_model_and_the_fix(tmp_path, capsys, monkeypatch):
    """`python -m tinyllm serve --model <a file not there>` says what is missing and how to
    fetch the real model, without a traceback; "smollm2" names the fetched file."""
    from tinyllm import __main__ as cli
    from tinyllm.checkpoints import smollm2

    missing = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--model", str(missing)])
    assert str(missing) in str(e.value) and "python -m tinyllm fetch smollm2" in str(e.value)
    monkeypatch.setattr(smollm2, "gguf_path", lambda fetch=True: missing)
    assert resolve("smollm2") == missing and resolve("default") == DEFAULT
    cli.main(["fetch", "smollm2"])
    assert capsys.readouterr().out.strip() == str(missing)

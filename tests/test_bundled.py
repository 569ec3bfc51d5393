"""Step 00 - the bundled checkpoint: loads by default, writes Shakespeare, ends its speeches."""

import json

from tinyllm.checkpoints.checkpoint import DEFAULT
from tinyllm.core.generate import generate


def test_tokenizer_round_trips_text(bundled):
    _, tok = bundled
    text = "Ham.\nTo be, or not to be, that is the question:\nWhether 'tis nobler in the mind"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id == tok.eos_id == 0, "every prompt starts with <|endoftext|>"
    assert tok.decode(ids) == text
    assert len(ids) < len(text) / 2.5, "BPE should compress English text"


def test_greedy_speeches_end_by_themselves(bundled):
    """The point of the checkpoint: answers stop at <|endoftext|>, at varied lengths."""
    model, tok = bundled
    outs = [
        generate(model, tok.encode(f"{s}\n"), 400, eos_id=tok.eos_id)
        for s in ["Ham.", "Oph.", "King.", "Rom.", "Jul.", "Nurse.", "Lear.", "Iago."]
    ]
    ended = [o for o in outs if o[-1] == tok.eos_id]
    assert len(ended) >= 7, f"only {len(ended)} of 8 greedy speeches ended by themselves"
    assert len({len(o) for o in ended}) >= 4, f"lengths barely vary: {[len(o) for o in ended]}"


def test_training_record_is_there():
    rec = json.loads((DEFAULT / "training.json").read_text())
    for key in ("steps", "seed", "train_minutes", "val_loss", "tokens_per_s", "parameters"):
        assert key in rec
    assert (DEFAULT / "model.safetensors").stat().st_size < 10e6, "the bundled weights are bf16"

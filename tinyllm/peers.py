"""Step 09 - the peers: one workload through tinyllm's engines and through transformers.

    python -m tinyllm bench --peers                     # the bundled model, longtail workload
    python -m tinyllm bench --peers --model DIR --workload eos --batch 8

transformers runs the same weights two ways: `generate()` on left-padded static batches (what
most people write first), and its continuous-batching manager (`init_continuous_batching`, the
engine behind `generate_batch`) with an explicit, small paged KV cache: by default it sizes the
cache from the machine's free memory. Every request's tokens are compared with tinyllm's solo
generate(): the table says how many agreed. Greedy workloads only (sampling draws differ).
"""

import time

import torch

from tinyllm.continuous import run_continuous
from tinyllm.generate import generate
from tinyllm.requests import Request, eos_ids
from tinyllm.static import run_static


def peer_model(path, device, dtype=torch.float32):
    """transformers' model of the checkpoint directory, in eval mode."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging
    logging.set_verbosity_error()       # it warns that eos -1 (no EOS) never stops a row: intended
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def upto(tokens: list[int], req: Request) -> list[int]:
    """A request's answer from a longer row: at most max_new_tokens, ending at its EOS."""
    tokens = tokens[:req.max_new_tokens]
    ends = [i for i, t in enumerate(tokens) if t in eos_ids(req.eos_id)]
    return tokens[:ends[0] + 1] if ends else tokens


@torch.no_grad()
def hf_static(peer, reqs: list[Request], batch: int, pad_id: int) -> list[list[int]]:
    """transformers' generate(), greedy, batch requests at a time, left-padded; each batch
    runs to its longest request, whose tokens a shorter request then drops."""
    device = next(peer.parameters()).device
    out = []
    for b0 in range(0, len(reqs), batch):
        group = reqs[b0:b0 + batch]
        L = max(len(r.prompt) for r in group)
        ids = torch.tensor([[pad_id] * (L - len(r.prompt)) + r.prompt for r in group], device=device)
        mask = torch.tensor([[0] * (L - len(r.prompt)) + [1] * len(r.prompt) for r in group],
                            device=device)
        eos = {eos_ids(r.eos_id) for r in group}
        if len(eos) > 1:                # generate() stops every row at the same EOS ids
            raise ValueError(f"requests {b0}..{b0 + len(group) - 1} of one batch end at different "
                             f"EOS ids {sorted(map(sorted, eos))}: generate() takes one set per batch")
        eos = sorted(eos.pop())
        gen = peer.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=pad_id,
                            max_new_tokens=max(r.max_new_tokens for r in group),
                            eos_token_id=eos or -1)
        out += [upto(row, r) for row, r in zip(gen[:, L:].tolist(), group)]
    return out


def hf_continuous(peer, reqs: list[Request], max_requests: int, block_size: int = 32,
                  n_blocks: int = 256) -> list[list[int]]:
    """transformers' continuous batching: every request queued at once, each with its own
    max_new_tokens and EOS, at most max_requests in a batch, in a KV cache of n_blocks pages
    of block_size tokens (explicit, so it does not size itself from the machine's memory)."""
    from transformers.generation import ContinuousBatchingConfig, GenerationConfig
    gc = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_new_tokens for r in reqs),
                          eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=block_size, num_blocks=n_blocks,
                                  max_requests_per_batch=max_requests,
                                  max_batch_tokens=max_requests * 64)
    manager = peer.init_continuous_batching(generation_config=gc, continuous_batching_config=cb)
    manager.start()
    try:
        ids = [manager.add_request(r.prompt, request_id=f"r{i}", max_new_tokens=r.max_new_tokens,
                                   eos_token_id=sorted(eos_ids(r.eos_id)) or -1)
               for i, r in enumerate(reqs)]
        results = {}
        while len(results) < len(ids):              # results come back in finishing order
            out = manager.get_result(timeout=600)
            if out is None:
                raise RuntimeError("transformers' continuous batching returned no result")
            if out.error:
                raise RuntimeError(f"transformers' continuous batching: {out.error}")
            results[out.request_id] = out
    finally:
        manager.stop(block=True)
    return [upto(list(results[rid].generated_tokens), r) for rid, r in zip(ids, reqs)]


def compare(model, peer, reqs: list[Request], batch: int, pad_id: int = 0) -> dict[str, dict]:
    """Each engine on the same requests: wall time, tokens, tokens/s, and how many requests'
    tokens equal tinyllm's solo generate()."""
    if any(r.sampling is not None for r in reqs):
        raise ValueError("the peer comparison is greedy: tokens of sampled requests would differ")
    solo = [generate(model, r.prompt, r.max_new_tokens, eos_id=r.eos_id) for r in reqs]
    max_len = max(len(r.prompt) + r.max_new_tokens for r in reqs)   # the KV cache fits the work
    kv_mib = {}

    def tinyllm_continuous(rs, **kw):
        results, summary = run_continuous(model, rs, batch, max_len=max_len, **kw)
        kv_mib[kw.get("kv", "slots")] = summary["kv_reserved_mib"]
        return [r.tokens for r in results]

    engines = {
        "tinyllm static": lambda rs: [r.tokens for r in run_static(model, rs, batch)[0]],
        "tinyllm continuous": lambda rs: tinyllm_continuous(rs),
        "tinyllm paged": lambda rs: tinyllm_continuous(rs, kv="paged"),
        "hf generate": lambda rs: hf_static(peer, rs, batch, pad_id),
        "hf continuous": lambda rs: hf_continuous(peer, rs, batch,
                                                  n_blocks=batch * -(-max_len // 32)),
    }
    warm = [Request(r.prompt, 4, r.eos_id) for r in reqs[:2]]
    rows = {}
    for name, fn in engines.items():
        fn(warm)                                        # first calls: allocator, kernel choice
        t0 = time.perf_counter()
        toks = fn(reqs)
        wall = time.perf_counter() - t0
        n = sum(map(len, toks))
        rows[name] = {"requests": len(reqs), "tokens": n, "wall_s": wall, "tok_s": n / wall,
                      "agree": sum(a == b for a, b in zip(toks, solo))}
    for name, kind in (("tinyllm continuous", "slots"), ("tinyllm paged", "paged")):
        rows[name]["kv_mib"] = kv_mib[kind]
    return rows


def table(rows: dict[str, dict]) -> str:
    lines = [f"{'':20}{'requests':>10}{'tokens':>8}{'wall_s':>9}{'tok_s':>9}{'== solo':>9}"
             f"{'KV MiB':>9}"]
    for name, r in rows.items():
        kv = f"{r['kv_mib']:>9.1f}" if "kv_mib" in r else f"{'-':>9}"
        lines.append(f"{name:20}{r['requests']:>10}{r['tokens']:>8}{r['wall_s']:>9.2f}"
                     f"{r['tok_s']:>9.0f}{r['agree']:>6}/{r['requests']}" + kv)
    return "\n".join(lines)

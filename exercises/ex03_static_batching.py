"""Exercise 03 - static batching: the static batch loop.

One seam of the reference package: `run_batch` is what `tinyllm.core.static.run_static` calls for
each batch of requests. `run_static` then counts the decode steps and wasted rows from your
Results, so the loop is all you write. Useful pieces (imported below):
`prefill_padded(model, prompts, max_len)` -> (last logits (B, V), cache, pads), and
`Result(tokens, ttft_s, latency_s)`, and `is_done(request, tokens)`: True after max_new_tokens
tokens or at the request's eos_id (kept as its last token). Decode steps feed the model (B, 1)
ids with `cache=cache`, inside `with autocast_for(device):` (bf16 on a GPU, nothing on a CPU).

Check your work with `make check EX=03` (or `check_exercise("03")` in notebook 03). The tests
plug your loop into run_static and compare every request's tokens with solo generate().
"""

from tinyllm.core.generate import autocast_for
from tinyllm.core.model import Transformer
from tinyllm.core.padded import prefill_padded
from tinyllm.core.requests import Request, Result, is_done


def run_batch(model: Transformer, batch: list[Request], pick, clock) -> list[Result]:
    """One static batch: prefill the prompts together (prefill_padded, with room for the
    longest request's new tokens), then decode all rows together until every request is done.
    A row whose request has finished keeps computing; its tokens are thrown away.
    pick: logits (B, V) -> tokens (B, 1). clock() -> seconds since the run began: a Result's
    ttft_s is the clock when its first token was picked, latency_s when its last was."""
    raise NotImplementedError("exercise 03: prefill the batch, then decode all rows until every "
                              "request is done")


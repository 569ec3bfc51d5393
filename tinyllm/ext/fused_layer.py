"""Step 13 - the decode step with each layer in one C call.

The pieces (piecewise.py) fuse a layer's small operations, yet a step of SmolLM2 still makes
about 300 calls from Python: 31 compiled pieces, and inside them and between them the products,
the fused loops, the attention, each a dispatch of a few microseconds. At batch 1 on a CPU those
calls cost a quarter of a float32 step, and their Python's data is pushed out of the caches by
every layer's weights as they stream past. llama.cpp has none of that: its step is a graph of C
kernels, run from C. `FusedDecoder(model)` does the same for each layer: one call of
`cpu_kernels.decode_layer` computes the whole layer for the step's rows (norm, the q, k and v
product, RoPE, the attention in the cache, the output product, norm, the SwiGLU MLP, the two
residuals), the same loops as the kernels' own (float_gemv, decode_attention), so a step is the
embedding, 30 calls and the head. Nothing is compiled at run time and no batch is padded. The C
loops multiply a weight vector with 4 rows at a time, and each row's result depends on that
row alone. From a few dozen rows on, a step is arithmetic more than reading, and the math
library's blocked products do more of it a cycle, so a step of more than FUSED_ROWS (16) rows
runs the model as it is, as GemvLinear hands such products to the library.

It serves a model of float weights (float32, or float64 for the oracle tests) without biases on
a CPU, with a cache that says where its keys lie (`layout`: slots, a paged pool, a prefix
cache), the continuous engine's decoder="fused"; a model it cannot compute is refused by name
(`FusedDecoder.refusal`). A step of several tokens a row, or a cache without a layout or in
another dtype, runs the model as it is.
"""

import torch
from torch import Tensor, nn

from tinyllm.core.model import Transformer
from tinyllm.ext import cpu_kernels
from tinyllm.ext.cpu_attention import kernel_rows
from tinyllm.ext.quant import FUSED_ROWS, QuantLinear


def layer_weights(block) -> list[Tensor]:
    """A layer's weights in decode_layer's order: input norm, q, k, v, o, post-attention
    norm, gate, up, down."""
    attn, mlp = block.self_attn, block.mlp
    return [m.weight.detach() for m in (block.input_layernorm, attn.q_proj, attn.k_proj,
                                        attn.v_proj, attn.o_proj, block.post_attention_layernorm,
                                        mlp.gate_proj, mlp.up_proj, mlp.down_proj)]


class FusedDecoder:
    """A model's decode step with each layer in one C call: decoder(idx (B, 1), cache) ->
    (logits (B, 1, V), None), what model(idx, cache=cache) returns. The model is not changed."""

    def __init__(self, model: Transformer):
        why = self.refusal(model)
        if why is not None:
            raise ValueError(f"decoder='fused' cannot run this model: {why}")
        self.model = model
        self.weights = [layer_weights(block) for block in model.layers]

    @staticmethod
    def refusal(model: Transformer) -> str | None:
        """Why decode_layer cannot compute this model's layers, or None where it can."""
        if not cpu_kernels.available():
            return f"the C kernels are not built here: {cpu_kernels.why_not_built()}"
        p = model.embed_tokens.weight
        if p.device.type != "cpu" or p.dtype not in (torch.float32, torch.float64):
            return f"its weights are {p.dtype} on {p.device.type}, not float32 or float64 on a CPU"
        for block in model.layers:
            linears = [m for m in block.modules() if isinstance(m, (nn.Linear, QuantLinear))]
            if any(isinstance(m, QuantLinear) for m in linears):
                return "its layers are quantized (decode_layer reads float weights)"
            if any(m.bias is not None for m in linears):
                return "its layers have biases"
            if any(w.dtype != p.dtype or not w.is_contiguous() for w in layer_weights(block)):
                return "a layer's weight is not contiguous or not in the embeddings' dtype"
        return None

    def __getstate__(self):
        """Sent to another process (the server's engine), the decoder goes as its model: the
        layers' weight lists are views of the model's, found again on arrival."""
        return {"model": self.model}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model"])

    @torch.no_grad()
    def __call__(self, idx: Tensor, cache) -> tuple[Tensor, None]:
        m, (B, T) = self.model, idx.shape
        if (T != 1 or B > FUSED_ROWS or not hasattr(cache, "layout")
                or cache.k[0].dtype != m.embed_tokens.weight.dtype):
            return m(idx, cache=cache)                                  # the library's GEMMs
        cos, sin = m.rope(cache.begin_step(1))                          # (B or 1, 1, 1, hd)
        x = m.embed_tokens(idx).view(B, -1)                             # (B, d)
        for i, w in enumerate(self.weights):                            # x (B, d) a layer
            x = cpu_kernels.decode_layer(x, w, cos, sin, *kernel_rows(cache, i, x),
                                         m.cfg.n_heads, m.cfg.norm_eps)
        cache.end_step()
        return m.compute_logits(x).view(B, 1, -1), None                 # (B, 1, V)

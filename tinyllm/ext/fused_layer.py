"""Step 13 - the decode step's layers in one C call.

llama.cpp's decode step is a graph of C kernels, run from C. `FusedDecoder(model)` does the same
for the layers: one call of `cpu_kernels.decode_layers` computes every layer in turn for the
step's rows (the norms, the q, k and v product, RoPE, the attention in the cache, the output
product, the SwiGLU MLP, the residuals) with the kernels' own loops, so a step is the embedding,
one call and the head. The layers' weights go to C once, as one object (`cpu_kernels.layers`)
made with the decoder. Nothing is compiled at run time and no batch is padded; each row's result
depends on that row alone. A step of more than FUSED_ROWS rows, of several tokens a row, or with
a cache without a layout or in another dtype runs the model as it is.

It is the continuous engine's decoder="fused", on a CPU, for a model without biases whose
weights are float (float32, or float64 for the oracle tests) or quantized (int8, int4, a GGUF
file's blocks: each product the integer one its QuantLinear makes, the same bits); a model it
cannot compute is refused by name (`FusedDecoder.refusal`).
"""

import torch
from torch import Tensor, nn

from tinyllm.core.model import Transformer
from tinyllm.core.parts import DecodeStep
from tinyllm.core.slot_cache import RaggedStep
from tinyllm.ext import cpu_kernels
from tinyllm.ext.cpu_attention import QUERY_ROWS, kernel_rows
from tinyllm.ext.quant import FUSED_ROWS, QuantLinear

C_PRODUCTS = ("int8_gemv", "int4_gemv", "int8g_gemv")   # QuantLinear's C products


def layer_weights(block) -> list[Tensor]:
    """A layer's weights in decode_layer's order: input norm, q, k, v, o, post-attention
    norm, gate, up, down."""
    attn, mlp = block.self_attn, block.mlp
    return [m.weight.detach() for m in (block.input_layernorm, attn.q_proj, attn.k_proj,
                                        attn.v_proj, attn.o_proj, block.post_attention_layernorm,
                                        mlp.gate_proj, mlp.up_proj, mlp.down_proj)]


def quant_weights(block) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor]]:
    """A quantized layer's weights in decode_layers' order: the two norms, then the q, scale
    and zero (an empty tensor where it has none) of q, k, v, o, gate, up and down."""
    attn, mlp = block.self_attn, block.mlp
    products = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj,
                mlp.down_proj)
    none = torch.empty(0, dtype=torch.float16)
    return ([block.input_layernorm.weight.detach(), block.post_attention_layernorm.weight.detach()],
            [m.q for m in products], [m.scale for m in products],
            [none if m.zero is None else m.zero for m in products])


def c_product_of(m: nn.Module) -> str | None:
    """The C product a linear layer makes of a row of float32 on this CPU, or None."""
    c_kernel = getattr(m, "c_kernel", None)
    return None if c_kernel is None else c_kernel(torch.empty(1, m.in_features))


class FusedDecoder(DecodeStep):
    """A model's decode step with each layer in one C call: decoder(idx (B, 1), cache) ->
    (logits (B, 1, V), None), what model(idx, cache=cache) returns. The model is not changed."""

    verify_rows = FUSED_ROWS        # the most query rows verify computes; Speculator asks

    def __init__(self, model: Transformer):
        why = self.refusal(model)
        if why is not None:
            raise ValueError(f"decoder='fused' cannot run this model: {why}")
        self.model = model
        self.quantized = isinstance(model.layers[0].self_attn.q_proj, QuantLinear)
        weights = quant_weights if self.quantized else layer_weights
        self.weights = [weights(block) for block in model.layers]
        float64 = model.embed_tokens.weight.dtype == torch.float64
        self.stack = None if self.quantized and float64 else cpu_kernels.layers(  # checked once
            [t for w in self.weights for t in (sum(w, []) if self.quantized else w)],
            self.quantized, model.cfg.n_heads, model.cfg.head_dim, model.cfg.norm_eps)

    @staticmethod
    def refusal(model: Transformer) -> str | None:
        """Why decode_layers cannot compute this model's layers, or None where it can."""
        if not cpu_kernels.available():
            return f"the C kernels are not built here: {cpu_kernels.why_not_built()}"
        p = model.embed_tokens.weight
        if p.device.type != "cpu" or p.dtype not in (torch.float32, torch.float64):
            return f"its weights are {p.dtype} on {p.device.type}, not float32 or float64 on a CPU"
        for block in model.layers:
            linears = [m for m in block.modules() if isinstance(m, (nn.Linear, QuantLinear))]
            if any(m.bias is not None for m in linears):
                return "its layers have biases"
            if any(isinstance(m, QuantLinear) for m in linears):
                why = FusedDecoder.quant_refusal(block, linears)
                if why is not None:
                    return why
            elif any(w.dtype != p.dtype or not w.is_contiguous() for w in layer_weights(block)):
                return "a layer's weight is not contiguous or not in the embeddings' dtype"
        return None

    @staticmethod
    def quant_refusal(block, linears: list[nn.Module]) -> str | None:
        """Why decode_layers cannot compute this quantized layer, or None where it can."""
        kinds = [c_product_of(m) for m in linears]
        if any(k not in C_PRODUCTS for k in kinds):
            return ("its layers are not all quantized with a C product here (int8, int4 with "
                    "zero points, or GGUF's Q8_0, Q4_0, Q4_1)")
        attn, mlp = block.self_attn, block.mlp
        for stacked in [(attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)]:
            if len({(c_product_of(m), m.group_size) for m in stacked}) > 1:
                return "a layer's products that read the same x are quantized in different ways"
        return None

    def __getstate__(self):
        """Sent to another process (the server's engine), the decoder goes as its model: the
        layers' weight lists are views of the model's, found again on arrival."""
        return {"model": self.model}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model"])

    def computes(self, rows: int, cache) -> bool:
        """Whether decode_layers computes a step of `rows` query rows on this cache: at most
        FUSED_ROWS of them, a cache with a layout, in the weights' dtype (float32 where the
        products are quantized)."""
        dtype = self.model.embed_tokens.weight.dtype
        return (rows <= FUSED_ROWS and isinstance(cache, RaggedStep) and cache.k[0].dtype == dtype
                and self.stack is not None)

    @torch.no_grad()
    def __call__(self, idx: Tensor, cache) -> tuple[Tensor, None]:
        m, (B, T) = self.model, idx.shape
        if T != 1 or not self.computes(B, cache):
            return m(idx, cache=cache)                                  # the library's GEMMs
        cos, sin = m.rope(cache.begin_step(1))                          # (B or 1, 1, 1, hd)
        x = self.layers(m.embed_tokens(idx).view(B, -1), cos, sin, cache)      # (B, d)
        cache.end_step()
        return m.compute_logits(x).view(B, 1, -1), None                 # (B, 1, V)

    @torch.no_grad()
    def verify(self, idx: Tensor, q_lens: list[int], cache) -> Tensor | None:
        """Speculation's target pass (11) on the cache's planned ragged step, row b's q_lens[b]
        tokens of idx (B, T): each of the N new tokens a query row of decode_layers, which
        writes every row's key before any attends, so a guess sees the guesses before it ->
        logits (B, T, V) (a padded column's are zeros); None (nothing done) where the step
        is more rows than decode_layers takes, and the model computes it."""
        m, (B, T), N = self.model, idx.shape, sum(q_lens)
        if not self.computes(N, cache) or max(q_lens) > QUERY_ROWS:
            return None
        positions = cache.begin_step(T)                                 # (B, T)
        cols = (torch.arange(N, device=idx.device) if cache.packing is None
                else cache.packing.places)                              # (N,) of B * T
        cos, sin = m.rope(positions.reshape(1, -1)[:, cols])            # (1, 1, N, hd) each
        x = m.embed_tokens(idx.reshape(-1)[cols])                       # (N, d)
        x = self.layers(x, cos, sin, cache, torch.arange(N))
        cache.end_step()
        new = m.compute_logits(x)                                       # (N, V)
        logits = new.new_zeros(B * T, new.size(-1))
        logits[cols] = new
        return logits.view(B, T, -1)                                    # (B, T, V)

    def layers(self, x: Tensor, cos: Tensor, sin: Tensor, cache, tokens=None) -> Tensor:
        """x (M, d), the step's query rows (its decode rows, or `tokens`: kernel_rows'), through
        every layer in one C call -> (M, d)."""
        rows = [kernel_rows(cache, i, x, tokens) for i in range(len(self.weights))]
        write, read, stride, mask = rows[0][2:]                 # the same for every layer
        return cpu_kernels.decode_layers(x, self.stack, cos, sin, [r[0] for r in rows],
                                         [r[1] for r in rows], write, read, stride, mask)

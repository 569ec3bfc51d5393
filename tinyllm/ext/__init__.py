"""The later steps, each a plug-in to the core: it adds a part and edits no core file.

Step 11's speculative decoding (speculative: a proposer and its verify pass), step 12's
structured output (structured: a grammar's processor for the token stage), step 13's
quantized weights and CPU kernels (quant: layers installed by `quantize`; cpu_kernels and the
C and C++ of csrc/; cpu_attention: installed on a model; piecewise and fused_layer: decode
steps; huge_pages). `tinyllm.build` turns an EngineConfig into these parts.
"""

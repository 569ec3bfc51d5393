"""The core: steps 00-08, what notebooks 00-08 read, and the vocabulary every step speaks.

A module of step N here imports only modules of steps up to N. Step 00's model (model), 01's
KV cache and the oracle (kv_cache, generate), 02's padded prefill (padded), 03's static batching
(static), 04's continuous batching (slot_cache, scheduler, model_runner, continuous), 05's
paged KV cache (paged_kv), 06's decoders (cuda_graph, compiled), 07's chunked prefill
(chunked_prefill), 08's prefix caching (prefix_cache); and the vocabulary: requests, sampling,
logits_processors, token_stage, stats, config. Later steps live in `tinyllm.ext` and plug in.
"""

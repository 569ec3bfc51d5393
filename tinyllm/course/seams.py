"""The exercises' seams: which functions of the reference package each exercise writes.

A seam is a function that the package calls through its own module's namespace, so that a test
can put a learner's function in its place (pytest's monkeypatch) and run the whole engine end
to end against solo generation. This table is the one place that says which seams exist: the
exercise tests plug them with `plug`, `tinyllm.course.check` and its proof that every test fails on
the untouched stubs read it, and a test checks that no module imports a seam by name (the
patch would then miss that module's copy).
"""

import importlib

SEAMS: dict[str, tuple[tuple[str, str], ...]] = {
    "01": (("tinyllm.core.kv_cache", "append_kv"), ("tinyllm.core.generate", "decode_loop")),
    "02": (("tinyllm.core.padded", "left_pad"), ("tinyllm.core.kv_cache", "rope_positions"),
           ("tinyllm.core.kv_cache", "attention_mask")),
    "03": (("tinyllm.core.static", "run_batch"),),
    "04": (("tinyllm.core.scheduler", "admit_waiting"), ("tinyllm.core.scheduler", "leave_slot"),
           ("tinyllm.core.slot_cache", "ragged_mask")),
    "05": (("tinyllm.core.paged_kv", "allocate_blocks"), ("tinyllm.core.paged_kv", "free_blocks"),
           ("tinyllm.core.paged_kv", "grow_table"), ("tinyllm.core.paged_kv", "slot_mapping"),
           ("tinyllm.core.scheduler", "reserve_or_preempt")),
    "06": (("tinyllm.core.cuda_graph", "choose_bucket"),
           ("tinyllm.core.cuda_graph", "fill_static"), ("tinyllm.core.cuda_graph", "decode_step")),
    "07": (("tinyllm.core.chunked_prefill", "plan_step"),
           ("tinyllm.core.chunked_prefill", "next_chunk")),
    "08": (("tinyllm.core.prefix_cache", "block_hashes"),
           ("tinyllm.core.prefix_cache", "match_prefix"),
           ("tinyllm.core.prefix_cache", "take_blocks"),
           ("tinyllm.core.prefix_cache", "share_blocks"),
           ("tinyllm.core.prefix_cache", "release_blocks")),
    "10": (("tinyllm.serving.textstream", "next_piece"),
           ("tinyllm.serving.engine_loop", "dispatch"), ("tinyllm.serving.server", "sse_events"),
           ("tinyllm.serving.loadgen", "percentile"),
           ("tinyllm.core.logits_processors", "apply_penalties")),
    "11": (("tinyllm.ext.speculative", "accept_greedy"),
           ("tinyllm.ext.speculative", "accept_sampled"), ("tinyllm.ext.speculative", "roll_back")),
    "12": (("tinyllm.ext.structured", "walk"), ("tinyllm.ext.structured", "token_mask"),
           ("tinyllm.core.logits_processors", "apply_bitmask")),
    "13": (("tinyllm.ext.quant", "quantize_int8"), ("tinyllm.ext.quant", "quantize_int4"),
           ("tinyllm.ext.quant", "dequantize"), ("tinyllm.ext.quant", "fused_matmul")),
    "14": (("tinyllm.ext.parallel", "shard_ranges"), ("tinyllm.ext.parallel", "shard_column"),
           ("tinyllm.ext.parallel", "shard_row"), ("tinyllm.ext.parallel", "row_parallel")),
}


def seam_names(nn: str) -> list[str]:
    return [name for _, name in SEAMS[nn]]


def reference(nn: str) -> dict:
    """{name: the reference package's function} for exercise nn's seams."""
    return {name: getattr(importlib.import_module(module), name) for module, name in SEAMS[nn]}


def plug(monkeypatch, nn: str, impl, names=None) -> None:
    """Put impl's functions in place of exercise nn's seams (all of them, or those named)."""
    for module, name in SEAMS[nn]:
        if names is None or name in names:
            monkeypatch.setattr(importlib.import_module(module), name, getattr(impl, name))

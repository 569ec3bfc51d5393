"""The course wing: the tools that measure, draw and check the engine.

bench.py (named workloads on named engines), workloads.py (the requests they serve), peers.py
(tinyllm against transformers and llama.cpp), viz.py and overview.py (the notebooks'
pictures), check.py (the oracle's words and the exercise checker) and seams.py (which package
functions each exercise writes). Nothing in the engine or the server imports this wing.
"""

"""The engine's names in one place: `from tinyllm.engine import ContinuousEngine, Request, ...`.

A re-export module and nothing else; nothing inside the package imports it. Each name lives in
the module of its idea: requests.py (Request, Result, Event, TokenLogprobs), sampling.py
(Sampling), generate.py (solo, the oracle of a Request), stats.py (Stats, Trace), padded.py
(02), static.py (03), config.py (EngineConfig), continuous.py (04: the engine of parts,
run_engine), build.py (make_engine and run_continuous: an engine of any EngineConfig).
"""

from tinyllm.build import make_engine, run_continuous
from tinyllm.core.config import EngineConfig
from tinyllm.core.continuous import ContinuousEngine, run_engine
from tinyllm.core.generate import solo
from tinyllm.core.padded import prefill_padded
from tinyllm.core.requests import Event, Request, Result, TokenLogprobs
from tinyllm.core.sampling import Sampling
from tinyllm.core.static import run_static
from tinyllm.core.stats import Stats, Trace

__all__ = ["Sampling", "Request", "Result", "Stats", "Event", "TokenLogprobs", "Trace",
           "EngineConfig", "solo", "prefill_padded", "run_static", "ContinuousEngine",
           "make_engine", "run_engine", "run_continuous"]

"""The serving wing (step 10): the engine behind the OpenAI API, and a load generator.

server.py runs a ContinuousEngine in a process of its own behind FastAPI, the two speaking
the typed messages of messages.py; api.py checks the bodies; textstream.py turns a request's
tokens into settled text; responses.py writes the answers' JSON, their logprobs spelled as
logprobs.py says; and loadgen.py measures any OpenAI-compatible server.
It imports the engine and the checkpoints; never the course's tooling.
"""

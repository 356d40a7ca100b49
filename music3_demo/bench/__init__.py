"""GPU benchmarks, run as `python -m music3_demo.bench` (one JSON object; flags in `semantic.main`).

semantic.py: frames/s of the semantic engines against the bandwidth limit; song.py: a whole song's wall time, first
audio, per-stage busy time and peak memory. Teacher forcing (graph vs reference on the same codes) stays in
semantic/teacher_forcing.py: the engine's load-time self-check uses it too, not only the bench.
"""

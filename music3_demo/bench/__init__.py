"""GPU benchmarks: `python -m music3_demo.bench <benchmark> [flags]`, each printing one JSON object (cli.py lists
them; `<benchmark> --help` gives its flags).

report.py: the head every report starts with and how a bench ends (an exit status of 1 when a teacher-forced check
failed). Teacher forcing (graph vs reference on the same codes) stays in semantic/teacher_forcing.py: the engine's
load-time self-check uses it too, not only the bench.
"""

"""Imported by Python at start-up when this folder is on PYTHONPATH (tests/ui/engine_faults.py's subprocess_env):
applies the fault named in $MUSIC3_TEST_FAULT before the app or CLI builds its engine."""

import engine_faults

engine_faults.apply_from_env()

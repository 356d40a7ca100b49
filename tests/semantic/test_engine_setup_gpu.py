"""GPU: the fast engine's load-time self-check on full-size random weights passes, with a margin, and what it costs
(printed as one JSON line: the errors, the first check in the process, a second one, make_engine's record)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from music3_demo import random_models
from music3_demo.semantic import make_engine
from music3_demo.semantic.select import SELF_CHECK_MAX_ERROR, sample_once, self_check

pytestmark = pytest.mark.gpu


def test_self_check_passes_on_random_full_and_reports_its_time():
    from music3_demo.semantic.graph import GraphEngine

    device = torch.device("cuda:0")
    components = random_models.build_components(random_models.FULL, seed=0, device=device, dtype=torch.bfloat16)
    lm, depth = components["language_model"], components["rvq_depth_decoder"]
    engine = GraphEngine(lm, depth, device)
    seconds = []
    for _ in range(2):  # first: Triton compiles (or loads from its cache) and captures; then what a check costs
        started = time.perf_counter()
        errors = self_check(engine, lm, depth)
        sample_once(engine)
        torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - started)
    engine.release()
    del engine
    chosen, record = make_engine(lm, depth, device, "auto")
    print("\nself-check " + json.dumps({"errors": errors, "first_s": round(seconds[0], 3),
                                        "again_s": round(seconds[1], 3), "make_engine": record.as_dict()}))
    assert record.name == "graph" == chosen.name and record.fallback_reason is None, record
    assert all(value < SELF_CHECK_MAX_ERROR for value in errors.values()), errors
    assert record.check_s is not None and record.check_s < 3.0, "the check at load must stay under 3 s"
    assert lm.lm_head is None  # trimmed only after it passed

"""The serve stage's verdicts on constructed measurements, each forced: greedy outputs that differ where the
arithmetic is exact, a differing rate above the tolerance where it is not, passes of one server that disagree.
The serve stage computes these from each server's passes (`stages/serve.py`: `_median_pass`, `_compared`); here the
passes are given, so each branch is seen to fire and to stay quiet."""

from __future__ import annotations

import pytest

from orchestrator.engines.client import ServerError
from orchestrator.stages import serve

OUTPUTS = [[5, 6, 7, 8], [9, 10, 11, 12]]


def _pass(output_ids, tok_s: float = 100.0) -> dict:
    return {"concurrency": 1, "output_tok_s": tok_s, "latency_mean_s": 0.1, "accept_length": 2.0,
            "output_ids": output_ids}  # fmt: skip


def _servers(baseline, speculative) -> dict:
    runs = {mode: [serve._median_pass([_pass(ids)], 1, exact=False)] for mode, ids in
            (("baseline", baseline), ("speculative", speculative))}  # fmt: skip
    return {mode: {"runs": r} for mode, r in runs.items()}


def test_identical_greedy_outputs_raise_no_flag(tiny_config):
    flags = []
    result = serve._compared(tiny_config(), _servers(OUTPUTS, OUTPUTS), flags)
    assert flags == [] and result["greedy_outputs_identical"] and result["greedy_differing_token_rate"] == 0.0


def test_differing_greedy_outputs_on_exact_arithmetic_are_flagged_however_few(tiny_config):
    """The reference engine in float32 computes both servers exactly: one token off is a verification bug."""
    cfg = tiny_config()  # FAST: serve=reference, float32 on the CPU
    assert serve.exact_arithmetic(cfg)
    flags = []
    one_off = [[5, 6, 7, 99], OUTPUTS[1]]  # the last token of one answer: 1 of 8 tokens
    result = serve._compared(cfg, _servers(OUTPUTS, one_off), flags)
    assert result["greedy_differing_token_rate"] == pytest.approx(1 / 8)
    assert len(flags) == 1 and "differ (12.50% of tokens) in float32 on the reference engine" in flags[0]


def test_a_differing_rate_above_the_tolerance_is_flagged_below_it_not(tiny_config):
    """In bf16 (not exact) the rate is held to serve.greedy_token_tolerance: above it, flagged; at or below, not."""
    cfg = tiny_config("serve.precision=bfloat16", "serve.greedy_token_tolerance=0.2")
    assert not serve.exact_arithmetic(cfg)
    flags = []
    serve._compared(cfg, _servers(OUTPUTS, [[5, 6, 7, 99], OUTPUTS[1]]), flags)  # 1/8 = 12.5% <= 20%
    assert flags == []
    serve._compared(cfg, _servers(OUTPUTS, [[5, 99, 98, 97], OUTPUTS[1]]), flags)  # 3/8 = 37.5% > 20%
    assert len(flags) == 1 and "37.50% of greedy output tokens differ" in flags[0]
    assert "serve.greedy_token_tolerance=20.00%" in flags[0]


def test_passes_of_one_server_that_disagree_fail_where_exact_and_are_recorded_where_not():
    passes = [_pass(OUTPUTS, 100.0), _pass([[5, 6, 7, 8], [9, 10, 13, 14]], 110.0), _pass(OUTPUTS, 90.0)]
    with pytest.raises(ServerError, match=r"greedy outputs differ between passes at concurrency 1 \(25.00% of"):
        serve._median_pass(passes, 1, exact=True)
    median = serve._median_pass(passes, 1, exact=False)
    assert median["output_tok_s"] == 100.0 and median["pass_differing_token_rate"] == pytest.approx(2 / 8)
    assert median["output_tok_s_passes"] == [100.0, 110.0, 90.0]


def test_passes_measured_apart_are_said_to_be(tiny_config):
    """A cached baseline divided into fresh speculative passes, or passes added to cached ones, measured more than
    ten minutes apart: the result says when each was measured (`passes_apart`), within ten minutes it says nothing."""

    def servers(*ats):
        return {mode: {"measured_by": [{"at": at} for at in times]} for mode, times in zip(("baseline", "speculative"),
                                                                                          ats)}  # fmt: skip

    assert serve.measured_apart(servers(["2026-12-06T10:00:00+00:00"], ["2026-12-06T10:09:00+00:00"])) is None
    apart = serve.measured_apart(servers(["2026-12-06T08:00:00+00:00"], ["2026-12-06T10:00:00+00:00"]))
    assert apart.startswith("the passes were measured 120 minutes apart (baseline at 2026-12-06T08:00:00+00:00; ")
    pooled = serve.measured_apart(
        servers(["2026-12-06T10:00:00+00:00"], ["2026-12-06T10:00:00+00:00", "2026-12-06T11:30:00+00:00"])
    )
    assert "speculative at 2026-12-06T10:00:00+00:00, 2026-12-06T11:30:00+00:00" in pooled

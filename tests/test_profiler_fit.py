"""Link fits and the profile writer: pure Python parts of hgopt.profiler (no torch)."""

from __future__ import annotations

import pytest

from hgopt.profiler.fit import fit_allreduce, fit_point_to_point
from hgopt.profiler.writer import LayerMeasurement, TimingMeasurement, build_model_profile
from hgopt.spec import model_profile_from_dict, model_profile_to_dict


def test_point_to_point_fit_recovers_latency_and_bandwidth() -> None:
    lat, bps = 0.02, 12.5e6  # 20 ms, 100 Mbit/s
    sizes = [4096.0, 65536.0, 1e6, 4e6]
    fit = fit_point_to_point(sizes, [lat + x / bps for x in sizes])
    assert fit.latency_s == pytest.approx(lat, rel=1e-9)
    assert fit.bytes_per_s == pytest.approx(bps, rel=1e-9)
    assert fit.gbit_s == pytest.approx(0.1)
    assert fit.max_rel_residual < 1e-9


def test_allreduce_fit_inverts_the_ring_model() -> None:
    lat, bps, n = 0.005, 1e8, 3
    sizes = [1e4, 1e5, 1e6, 1e7]
    times = [2 * (n - 1) * lat + 2 * (n - 1) / n * x / bps for x in sizes]
    fit = fit_allreduce(sizes, times, n)
    assert fit.latency_s == pytest.approx(lat, rel=1e-9)
    assert fit.bytes_per_s == pytest.approx(bps, rel=1e-9)


def test_negative_intercept_is_clamped_to_zero_latency() -> None:
    # a token bucket's burst makes small messages faster than the line rate: intercept would be < 0
    sizes = [1e4, 1e5, 1e6]
    times = [max(x - 3e4, 1e3) / 1e7 for x in sizes]
    fit = fit_point_to_point(sizes, times)
    assert fit.latency_s == 0.0
    assert fit.bytes_per_s > 0


def test_fit_needs_two_sizes_and_a_growing_time() -> None:
    with pytest.raises(ValueError, match="two or more"):
        fit_point_to_point([1e6, 1e6], [0.1, 0.1])
    with pytest.raises(ValueError, match="does not grow"):
        fit_point_to_point([1e3, 1e6], [0.2, 0.1])
    with pytest.raises(ValueError, match=">= 2 ranks"):
        fit_allreduce([1e3, 1e6], [0.1, 0.2], 1)


def _layers(n: int) -> list[LayerMeasurement]:
    return [LayerMeasurement(name=f"l{i}", kind="block", params=10.0, activation_bytes=4.0, act_mem_bytes=8.0)
            for i in range(n)]


def test_writer_output_round_trips_through_the_spec_reader() -> None:
    t = TimingMeasurement(gpu="cpu", tp=1, mbs=2, fwd=(0.1, 0.2), bwd=(0.2, 0.4), update=(0.01, 0.01))
    p = build_model_profile(name="m", dtype="fp32", seq_len=16, layers=_layers(2), timings=[t], source="test")
    again = model_profile_from_dict(model_profile_to_dict(p))
    assert again == p
    assert p.timings[0].fwd == (0.1, 0.2)


def test_writer_rejects_a_timing_with_the_wrong_layer_count() -> None:
    t = TimingMeasurement(gpu="cpu", tp=1, mbs=1, fwd=(0.1,), bwd=(0.2,), update=(0.0,))
    with pytest.raises(ValueError, match="expected 2"):
        build_model_profile(name="m", dtype="fp32", seq_len=16, layers=_layers(2), timings=[t], source="")

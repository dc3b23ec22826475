"""experiments/scaling_model.py: the alpha-beta formulas, and the paper's three timing
findings (rule 16) reproduced from the paper's constants."""

import math
from dataclasses import replace

import numpy as np
import pytest

from experiments import scaling_model as sm

ALPHA, BETA = 10e-6, 50e9 / 8  # the paper's 50 GbE, the model's assumed latency
MB100 = 100e6


# ------------------------------------------------------------------------ the findings


def test_finding_a_scaling_efficiency_8_to_256_gpus():
    eff = sm.scaling_efficiency(sm.paper_setting(), 256)
    assert 0.85 <= eff <= 0.95  # paper: ~90%


def test_finding_b_time_per_iteration_kn_256_to_11k():
    s = sm.paper_setting()
    increase = sm.evaluate(s, 352).t_iter / sm.evaluate(s, 8).t_iter - 1
    assert sm.evaluate(s, 352).kn == 11264
    assert 0.05 <= increase <= 0.20  # paper: 12%


def test_finding_c_halving_doubling_vs_ring_at_32_servers():
    assert 2.0 <= sm.ring_vs_halving_doubling(32) <= 4.0  # paper: ~3x


def test_findings_table_lists_model_and_paper_values():
    findings = sm.paper_findings()
    assert [f.paper for f in findings[:3]] == ["~90%", "12%", "~3x"]
    # the peak bandwidth need of rule 16 (~15 Gbit/s) follows from 102 MB in 120 ms
    assert 10 <= findings[3].model <= 16


def test_calibration_helpers_invert_the_model():
    s = sm.paper_setting()
    f = sm.hidden_fraction_for_efficiency(0.9)
    exact = replace(s, hidden_fraction=f)
    assert sm.scaling_efficiency(exact, 256) == pytest.approx(0.9)
    a = sm.alpha_for_speedup(3.0)
    s3 = replace(s, inter=sm.Link(alpha=a, beta=s.inter.beta))
    assert sm.ring_vs_halving_doubling(32, s3) == pytest.approx(3.0)


# ------------------------------------------------------------------------- the workload


def test_resnet50_has_161_tensors_and_25_6m_parameters():
    counts = sm.resnet50_param_counts()
    assert len(counts) == 161
    assert counts.sum() == 25_557_032  # torchvision's resnet50 parameter count
    assert counts.sum() * sm.FP32 == pytest.approx(102.2e6, rel=1e-3)


def test_buckets_keep_every_byte_and_respect_the_cap():
    tensor_bytes = sm.resnet50_param_counts() * sm.FP32
    buckets = sm.bucket_buffers(tensor_bytes, sm.BUCKET_25MB)
    assert buckets.sum() == tensor_bytes.sum()
    assert all(b >= sm.BUCKET_25MB for b in buckets[:-1])
    assert len(sm.bucket_buffers(tensor_bytes, 1.0)) == 161  # tiny cap: one per tensor


# -------------------------------------------------------------------------- formulas


def test_ring_costs_nothing_on_one_process():
    assert sm.ring_allreduce_time(MB100, 1, ALPHA, BETA) == 0
    assert sm.halving_doubling_allreduce_time(MB100, 1, ALPHA, BETA) == 0
    assert sm.intra_server_time(MB100, 1, ALPHA, BETA) == 0


def test_ring_formula_and_its_bandwidth_limit():
    p = 4
    expected = 2 * (p - 1) * ALPHA + 2 * (p - 1) / p * MB100 / BETA
    assert sm.ring_allreduce_time(MB100, p, ALPHA, BETA) == pytest.approx(expected)
    # bandwidth-optimal: the bandwidth term tends to 2 * bytes / beta for large p
    big = sm.ring_allreduce_time(MB100, 100_000, 0.0, BETA)
    assert big == pytest.approx(2 * MB100 / BETA, rel=1e-4)
    assert big < 2 * MB100 / BETA


def test_halving_doubling_uses_2_log2_p_latency_steps():
    for p in (2, 4, 32, 1024):
        latency = sm.halving_doubling_allreduce_time(0.0, p, ALPHA, BETA)
        assert latency == pytest.approx(2 * math.log2(p) * ALPHA)
        ring_latency = sm.ring_allreduce_time(0.0, p, ALPHA, BETA)
        assert ring_latency == pytest.approx(2 * (p - 1) * ALPHA)


def test_halving_doubling_moves_the_same_bytes_as_the_ring_for_powers_of_two():
    for p in (2, 8, 32):
        hd = sm.halving_doubling_allreduce_time(MB100, p, 0.0, BETA)
        assert hd == pytest.approx(sm.ring_allreduce_time(MB100, p, 0.0, BETA))


def test_non_power_of_two_binary_blocks_and_fold():
    # 44 = 32 + 8 + 4: the largest block's 2 log2 32 steps + 2 extra steps, and each of
    # the 2 smaller blocks adds a chunk of bytes/32 per phase
    latency = sm.halving_doubling_allreduce_time(0.0, 44, ALPHA, BETA)
    assert latency == pytest.approx((2 * 5 + 2) * ALPHA)
    moved = sm.halving_doubling_allreduce_time(MB100, 44, 0.0, BETA) * BETA / MB100
    assert moved == pytest.approx(2 * (31 + 2) / 32)
    # fold: the power-of-two core plus two full-buffer steps; never cheaper
    fold = sm.halving_doubling_fold_time(MB100, 44, ALPHA, BETA)
    core = sm.halving_doubling_allreduce_time(MB100, 32, ALPHA, BETA)
    assert fold == pytest.approx(core + 2 * (ALPHA + MB100 / BETA))
    assert fold > sm.halving_doubling_allreduce_time(MB100, 44, ALPHA, BETA) > core
    assert sm.halving_doubling_fold_time(MB100, 32, ALPHA, BETA) == pytest.approx(core)


def test_formulas_are_vectorised_over_buffers():
    sizes = np.array([1e3, 1e6, 1e8])
    t = sm.ring_allreduce_time(sizes, 8, ALPHA, BETA)
    assert t.shape == (3,) and np.all(np.diff(t) > 0)


def test_torus_dims_and_torus_time():
    assert sm.torus_dims(8) == (2, 2, 2)
    assert sm.torus_dims(256) == (4, 8, 8)
    assert sm.torus_dims(1024) == (8, 8, 16)
    with pytest.raises(ValueError):
        sm.torus_dims(48)
    # one dimension of size d >= 3 is a bidirectional ring: twice the link bandwidth
    one_dim = sm.torus_allreduce_time(MB100, (1, 1, 8), ALPHA, BETA)
    assert one_dim == pytest.approx(sm.ring_allreduce_time(MB100, 8, ALPHA, 2 * BETA))
    # later dimensions work on the shard left by the earlier reduce-scatters
    two_dims = sm.torus_allreduce_time(MB100, (4, 8), ALPHA, BETA)
    expected = sm.ring_allreduce_time(MB100, 4, ALPHA, 2 * BETA) + sm.ring_allreduce_time(
        MB100 / 4, 8, ALPHA, 2 * BETA
    )
    assert two_dims == pytest.approx(expected)


def test_iteration_time_hides_a_fraction_of_communication_behind_backprop():
    assert sm.iteration_time(0.06, 0.12, 0.05, 0.0) == pytest.approx(0.23)
    assert sm.iteration_time(0.06, 0.12, 0.05, 0.5) == pytest.approx(0.205)
    assert sm.iteration_time(0.06, 0.12, 0.05, 1.0) == pytest.approx(0.18)
    # never more hidden than the backprop time
    assert sm.iteration_time(0.06, 0.12, 1.0, 1.0) == pytest.approx(0.06 + 1.0)
    with pytest.raises(ValueError):
        sm.iteration_time(0.06, 0.12, 0.05, 1.5)


def test_one_server_has_no_inter_server_traffic():
    pt = sm.evaluate(sm.paper_setting(), 8)
    assert pt.t_inter == 0 and pt.t_intra > 0 and pt.kn == 256


# ------------------------------------------------------------------------------- CLI


def test_cli_writes_markdown_and_png(tmp_path, capsys):
    assert sm.main(["--out", str(tmp_path)]) == 0
    md = (tmp_path / "scaling_model.md").read_text()
    assert sm.COMMAND in md
    for text in ("(a) scaling efficiency", "(b) time/iter", "(c) ring", "H100", "TPU v5p"):
        assert text in md
    png = (tmp_path / "scaling_model.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert "(c) ring" in capsys.readouterr().out
    # deterministic
    assert sm.report() == md

"""The cost model: document 000's Table 5.1, the α-β-γ formulas, and calibration on real ranks."""
import io
import json
import math
from contextlib import redirect_stdout
from fractions import Fraction

import pytest

from helpers import SHARED
from hypothesis import given
from hypothesis import strategies as st

from ddtrain import cli
from ddtrain.costmodel import (PREDICTORS, LinkParams, bus_bandwidth_factor, butterfly_time, central_time,
                               count_table, format_count, native_time, predict_time, ring_async_time,
                               ring_time, tree_time)
from ddtrain.costmodel.calibration import fit_line
from ddtrain.errors import DDTrainError
from multirank import run_ranks

# Document 000, Table 5.1, as printed (E = 10): N, R, centralized, decentralized, proposed.
# Transcribed from the PDF-to-text (tab-separated, 49 rows, one page break after N=50, R=8).
DOCUMENT_TABLE_5_1 = """
1 2 20 10 11
1 4 60 15 18
1 8 140 17.5 24.5
1 50 980 19.6 68.6
1 100 1980 19.8 118.8
1 500 9980 19.96 518.96
1 1000 19980 19.98 1018.98
4 2 80 40 44
4 4 240 60 72
4 8 560 70 98
4 50 3920 78.4 274.4
4 100 7920 79.2 475.2
4 500 39920 79.84 2075.84
4 1000 79920 79.92 4075.92
8 2 160 80 88
8 4 480 120 144
8 8 1120 140 196
8 50 7840 156.8 548.8
8 100 15840 158.4 950.4
8 500 79840 159.68 4151.68
8 1000 159840 159.84 8151.84
50 2 1000 500 550
50 4 3000 750 900
50 8 7000 875 1225
50 50 49000 980 3430
50 100 99000 990 5940
50 500 499000 998 25948
50 1000 999000 999 50949
100 2 2000 1000 1100
100 4 6000 1500 1800
100 8 14000 1750 2450
100 50 98000 1960 6860
100 100 198000 1980 11880
100 500 998000 1996 51896
100 1000 1998000 1998 101898
500 2 10000 5000 5500
500 4 30000 7500 9000
500 8 70000 8750 12250
500 50 490000 9800 34300
500 100 990000 9900 59400
500 500 4990000 9980 259480
500 1000 9990000 9990 509490
1000 2 20000 10000 11000
1000 4 60000 15000 18000
1000 8 140000 17500 24500
1000 50 980000 19600 68600
1000 100 1980000 19800 118800
1000 500 9980000 19960 518960
1000 1000 19980000 19980 1018980
"""
DOC_ROWS = [line.split() for line in DOCUMENT_TABLE_5_1.strip().splitlines()]
PARAMS = [1, 4, 8, 50, 100, 500, 1000]       # N of Table 5.1
WORKERS = [2, 4, 8, 50, 100, 500, 1000]      # R of Table 5.1
SEED = SHARED / "seeds"


def test_the_transcription_has_the_documents_49_rows_in_its_grid():
    assert len(DOC_ROWS) == 49
    assert [(int(r[0]), int(r[1])) for r in DOC_ROWS] == [(n, r) for n in PARAMS for r in WORKERS]


def test_the_transcription_matches_the_seed_text():
    files = sorted(SEED.glob("000_*.txt"))
    if not files:
        pytest.skip(f"document 000 is not at {SEED}")
    lines = files[0].read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("No. of elements in each node (N)"))
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("**Table 5.1**"))
    assert [line.split() for line in lines[start + 1:end] if line.strip()] == DOC_ROWS


def test_table_5_1_matches_the_document_exactly_and_prints_as_printed_there():
    rows = count_table(PARAMS, WORKERS, steps_per_epoch=10)
    for row, printed in zip(rows, DOC_ROWS):
        assert (row.params, row.workers) == (int(printed[0]), int(printed[1]))
        ours = (row.centralized, row.decentralized, row.proposed)
        assert ours == tuple(Fraction(v) for v in printed[2:]), printed
        assert tuple(format_count(v) for v in ours) == tuple(printed[2:])


@given(st.integers(0, 10**9), st.integers(1, 10**4), st.integers(0, 10**4))
def test_counts_follow_the_documents_formulas(n, r, e):
    row = count_table([n], [r], e)[0]
    assert row.centralized == 2 * e * n * (r - 1)
    assert row.decentralized * r == 2 * e * n * (r - 1)          # 2·E·(N/R)·(R−1), exactly
    assert row.proposed - row.decentralized == n * (r - 1)       # one broadcast of N per epoch
    assert row.centralized == r * row.decentralized              # the ring moves 1/R of the master's load


def test_more_broadcasts_per_epoch_add_n_times_r_minus_1_each():
    once, every_step = count_table([100], [4], 10, 1)[0], count_table([100], [4], 10, 10)[0]
    assert every_step.proposed - once.proposed == 9 * 100 * 3


def _cli(*argv) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out):
        code = cli.main(list(argv))
    return code, out.getvalue()


def test_model_comm_prints_table_5_1_by_default():
    code, text = _cli("model", "comm")
    assert code == 0
    data = [line.split() for line in text.splitlines() if not line.startswith("#")]
    assert data == DOC_ROWS
    assert all(line.startswith(("#", "  ")) for line in text.splitlines())


def test_model_comm_json_for_any_grid():
    code, text = _cli("model", "comm", "--params", "1,4,8", "--workers", "2,4,8", "--steps-per-epoch", "10", "--json")
    assert code == 0
    rows = json.loads(text)["rows"]
    assert [[r["params"], r["workers"], r["centralized"], r["decentralized"], r["proposed"]] for r in rows] == \
        [[float(x) if "." in x else int(x) for x in row] for row in DOC_ROWS if int(row[0]) in (1, 4, 8)
         and int(row[1]) in (2, 4, 8)]
    assert rows[2]["decentralized_exact"] == "35/2"


def test_model_comm_rejects_bad_input(capsys):
    assert cli.main(["model", "comm", "--params", "1,x"]) == 2
    assert "not a whole number" in capsys.readouterr().err
    assert cli.main(["model", "comm", "--workers", "0"]) == 2


# --- α-β-γ: closed forms against step-by-step sums of each algorithm's schedule ---------------

def _steps(algorithm, n, p):
    """The critical path as (messages, bytes per message, bytes reduced) per step, written out."""
    if p == 1:
        return []
    if algorithm in ("ring", "native", "ring-async"):
        chunk = n / p
        return [(1, chunk, chunk)] * (p - 1) + [(1, chunk, 0)] * (p - 1)
    if algorithm == "butterfly":
        core = 2 ** int(math.log2(p))
        fold = [(1, n, n)] if core < p else []
        halving = [(1, n / 2 ** k, n / 2 ** k) for k in range(1, int(math.log2(core)) + 1)]
        doubling = [(1, m, 0) for _, m, _ in reversed(halving)]
        return fold + halving + doubling + ([(1, n, 0)] if core < p else [])
    if algorithm == "tree":
        levels = math.ceil(math.log2(p))
        return [(1, n, n)] * levels + [(1, n, 0)] * levels
    if algorithm == "central":   # the root takes p−1 buffers in, adds each, sends p−1 out
        return [(1, n, n)] * (p - 1) + [(1, n, 0)] * (p - 1)
    raise ValueError(algorithm)


def _sum_of_steps(algorithm, n, p, a, b, g):
    total = 0.0
    for messages, nbytes, reduced in _steps(algorithm, n, p):
        transfer = messages * a + nbytes * b
        add = reduced * g
        # ring-async (and native, a segmented ring) overlap the add with the transfer
        total += max(transfer, a + add) if algorithm in ("ring-async", "native") and reduced else transfer + add
    return total


@pytest.mark.parametrize("algorithm", sorted(PREDICTORS))
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 6, 7, 8, 16, 100])
@pytest.mark.parametrize("n", [0, 4, 1000, 2**20, 3 * 10**7])
def test_each_formula_equals_the_sum_over_its_steps(algorithm, p, n):
    a, b, g = 2e-5, 1e-9, 3e-10
    expected = 0.0 if n == 0 else _sum_of_steps(algorithm, n, p, a, b, g)
    got = predict_time(algorithm, n, p, LinkParams(alpha_s=a, beta_s_per_byte=b, gamma_s_per_byte=g))
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_the_issue_formulas_by_hand():
    a, b, n = 1e-5, 1e-9, 10**6
    assert ring_time(n, 4, a, b) == pytest.approx(2 * 3 * a + 2 * 0.75 * n * b)          # 2(p−1)α + 2((p−1)/p)nβ
    assert butterfly_time(n, 8, a, b) == pytest.approx(2 * 3 * a + 2 * 7 / 8 * n * b)    # 2·log2(p)·α + …
    assert tree_time(n, 8, a, b) == pytest.approx(2 * 3 * (a + n * b))                  # 2·log2(p)(α + nβ)
    assert central_time(n, 4, a, b) == pytest.approx(2 * 3 * (a + n * b))
    assert ring_time(n, 4, a, b, 1e-10) - ring_time(n, 4, a, b) == pytest.approx(0.75 * n * 1e-10)
    assert native_time(n, 4, a, b, 1e-10) == ring_async_time(n, 4, a, b, 1e-10)


def test_shapes_of_the_model():
    a, b = 1e-4, 1e-9
    # Ring and butterfly move the same bytes; butterfly pays fewer latencies from p = 4 on.
    assert butterfly_time(2**20, 8, a, b) < ring_time(2**20, 8, a, b)
    # Tree and central move whole buffers: for large messages they lose to the ring.
    assert ring_time(2**26, 8, a, b) < tree_time(2**26, 8, a, b) < central_time(2**26, 8, a, b)
    assert bus_bandwidth_factor(4) == 1.5 and bus_bandwidth_factor(1) == 0.0


def test_bad_inputs_are_refused():
    with pytest.raises(DDTrainError, match="valid: butterfly, central, native, ring, ring-async, tree"):
        predict_time("hypercube", 8, 2, LinkParams(alpha_s=0, beta_s_per_byte=0))
    with pytest.raises(DDTrainError, match="ranks"):
        ring_time(8, 0, 1, 1)
    with pytest.raises(ValueError, match="alpha_s"):
        LinkParams(alpha_s=-1, beta_s_per_byte=0)


def test_fit_line_recovers_alpha_and_beta():
    sizes = [4 * 4**k for k in range(12)]
    alpha, beta, residual = fit_line(sizes, [3e-5 + 2e-9 * m for m in sizes])
    assert alpha == pytest.approx(3e-5) and beta == pytest.approx(2e-9) and residual < 1e-9
    noisy = [(3e-5 + 2e-9 * m) * (1.1 if k % 2 else 0.9) for k, m in enumerate(sizes)]
    alpha, beta, _ = fit_line(sizes, noisy)
    assert alpha == pytest.approx(3e-5, rel=0.25) and beta == pytest.approx(2e-9, rel=0.25)


# --- calibration on real ranks --------------------------------------------------------------

def _calibrate_on_ranks():
    from ddtrain.costmodel import calibrate
    return calibrate(max_bytes=4 << 20, budget_s=1.5).as_dict()


def test_calibration_on_two_ranks_fits_a_positive_latency_and_bandwidth():
    results = run_ranks(_calibrate_on_ranks, 2)
    assert results[0]["params"] == results[1]["params"]      # every rank agrees
    params = results[0]["params"]
    assert 1e-7 < params["alpha_s"] < 0.05                   # between 0.1 us and 50 ms
    assert 1e-3 < params["bandwidth_GBps"] < 1000            # between 1 MB/s and 1 TB/s
    assert params["gamma_s_per_byte"] > 0
    exchange = results[0]["exchange"]
    assert exchange["sizes"][0] == 4 and exchange["sizes"][-1] == 4 << 20
    # The fitted line goes through the measurements it came from, roughly (noisy machine).
    big = exchange["times_s"][-1]
    assert params["alpha_s"] + params["beta_s_per_byte"] * (4 << 20) == pytest.approx(big, rel=1.0)


def test_fit_line_without_relative_weights_follows_the_large_sizes():
    # Adds: in-cache small buffers are faster per byte; the slope must be the large buffers'.
    sizes = [256 << 10, 1 << 20, 4 << 20, 16 << 20]
    times = [1e-5, 1e-4, 6e-4, 2.6e-3]
    _, beta, _ = fit_line(sizes, times, relative=False)
    assert beta == pytest.approx(2.6e-3 / (16 << 20), rel=0.1)
    alpha, beta, _ = fit_line([8, 16, 32], [1e-4, 1e-4, 1e-4])              # flat: all latency
    assert alpha == pytest.approx(1e-4) and beta == pytest.approx(0, abs=1e-15)

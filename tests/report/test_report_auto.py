"""The report of an auto run: its trials, switches and re-checks as tables, and the step-time picture."""
import pytest

from ddtrain.report.auto import auto_blocks, step_times

AUTO = {"allow": ["powersgd"], "risks": {"powersgd": "powersgd: a rank-4 gradient"},
        "trials": [{"round": 0, "label": "ddp none (native)", "predicted_step_s": 0.3, "measured_step_s": 0.32,
                    "steps": 4, "start_step": 0},
                   {"round": 0, "label": "ddp powersgd:4:2 (native)", "predicted_step_s": 0.2, "measured_step_s": 0.18,
                    "steps": 5, "start_step": 4}],
        "switches": [{"step": 0, "from": None, "to": "ddp none (native)", "why": "start", "seconds": 0.01},
                     {"step": 4, "from": "ddp none (native)", "to": "ddp powersgd:4:2 (native)", "why": "trial",
                      "seconds": 0.2}],
        "rechecks": [{"step": 30, "label": "ddp powersgd:4:2 (native)", "baseline_wait_s": 0.05, "wait_s": 0.02,
                      "ratio": 0.4, "link_ratio": 0.1}],
        "choice": {"step": 9, "since_step": 4, "label": "ddp powersgd:4:2 (native)", "measured_step_s": 0.18},
        "selection_s": 1.5, "step_times": [[i, 0.3 if i < 4 else 0.18, "ddp none (native)" if i < 4 else
                                            "ddp powersgd:4:2 (native)"] for i in range(1, 40)]}


def test_tables_say_what_was_tried_and_chosen():
    record = {"auto": AUTO, "epochs": [{"time_s": 15.0}]}
    blocks = auto_blocks("run.json", record, lambda slug, draw, *a: ("img", slug, "t"))
    text = " ".join(str(b[1]) for b in blocks if b[0] == "p")
    assert "Committed to **ddp powersgd:4:2 (native)** at step 9 (running since step 4)" in text
    assert "10.0 % of the training time" in text and "Risk: powersgd" in text
    tables = [b for b in blocks if b[0] == "table"]
    assert [row[1] for row in tables[0][2]] == ["ddp none (native)", "ddp powersgd:4:2 (native)"]
    assert tables[0][2][1][2:4] == ["200.0", "180.0"]          # predicted, measured (ms)
    assert [row[3] for row in tables[1][2]] == ["start", "trial"]
    assert tables[2][2][0][-1] == "0.10"                        # the link probe's ratio
    assert blocks[-1] == ("img", "auto-steps-run.json", "t")


@pytest.mark.slow   # importing matplotlib takes seconds on the shared 2-core machine
def test_step_time_picture(tmp_path):
    pytest.importorskip("matplotlib")
    title = step_times(AUTO, "run.json", tmp_path / "steps.png")
    assert "switches marked" in title and (tmp_path / "steps.png").stat().st_size > 0

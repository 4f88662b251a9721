"""``ddtrain advise``: the ranked table and --json from a small model, and one clear error for every bad input."""
import json

import pytest

from helpers import assert_one_clear_error, ddtrain

from ddtrain import cli

BASE = ["advise", "--model", "mlp", "--data", "mnist", "--workers", "4", "--step-time", "20ms",
        "--link-rate", "100mbit", "--latency", "2ms", "--compressions", "none,fp16", "--sync-every", "4"]


def test_json_ranks_every_method_and_picks_the_fastest_eligible(tmp_path, capsys):
    out = tmp_path / "advice.json"
    assert cli.main([*BASE, "--burst", "emulated", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "# first choice:" in table and "bytes/step" in table
    advice = json.loads(out.read_text())
    ranked = advice["ranked"]
    times = [r["step_s"] for r in ranked]
    assert times == sorted(times)
    # every DDP-family strategy with both compressions, and local-sgd at K=4 with either outer step
    assert {r["label"] for r in ranked} >= {"ddp none (native)", "ring fp16", "tree none", "local-sgd average K=4",
                                            "local-sgd nesterov K=4"}
    eligible = [r for r in ranked if r["eligible"]]
    assert advice["first_choice"]["label"] == eligible[0]["label"]
    # mlp (784-128-128-10): 118 282 parameters; a ring sends 2(R-1)/R of them, fp16 half of that
    ring = next(r for r in ranked if r["label"] == "ring none")
    assert ring["bytes_per_step"] == pytest.approx(1.5 * 4 * 118_282)
    assert next(r for r in ranked if r["label"] == "ring fp16")["bytes_per_step"] == pytest.approx(0.75 * 4 * 118_282)
    assert advice["network"]["burst_bytes"] == 65536


def test_calibration_file_and_params(tmp_path, capsys):
    cal = tmp_path / "loaded.json"
    cal.write_text(json.dumps({"loaded": {"alpha_s": 0.003, "beta_s_per_byte": 8e-8, "burst_bytes": 1000}}))
    assert cli.main(["advise", "--params", "1_000_000", "--workers", "2", "--step-time", "0.1",
                     "--calibration", str(cal), "--compressions", "none", "--sync-every", "20", "--json", "-"]) == 0
    advice = json.loads(capsys.readouterr().out)
    assert advice["network"]["alpha_s"] == 0.003 and advice["network"]["burst_bytes"] == 1000
    assert advice["workload"]["params"] == 1_000_000


@pytest.mark.parametrize("argv, phrase", [
    (["--workers", "4", "--step-time", "1", "--link-rate", "1gbit"], "--model NAME or --params"),
    (["--model", "mlp", "--params", "5", "--workers", "4", "--step-time", "1", "--link-rate", "1gbit"], "exactly one"),
    (["--model", "nope", "--workers", "4", "--step-time", "1", "--link-rate", "1gbit"], "nope"),
    (["--model", "mlp", "--workers", "0", "--step-time", "1", "--link-rate", "1gbit"], "--workers"),
    (["--model", "mlp", "--workers", "4", "--link-rate", "1gbit"], "--step-time"),
    (["--model", "mlp", "--workers", "4", "--step-time", "fast", "--link-rate", "1gbit"], "--step-time"),
    (["--model", "mlp", "--workers", "4", "--step-time", "1"], "--link-rate"),
    (["--model", "mlp", "--workers", "4", "--step-time", "1", "--link-rate", "100mbps"], "ambiguous"),
    (["--model", "mlp", "--workers", "4", "--step-time", "1", "--link-rate", "1gbit", "--latency", "soon"], "--latency"),
    (["--model", "mlp", "--workers", "4", "--step-time", "1", "--link-rate", "1gbit", "--compressions", "zip"],
     "compression"),
    (["--model", "mlp", "--workers", "4", "--step-time", "1", "--link-rate", "1gbit", "--sync-every", "0"],
     "--sync-every"),
    (["--model", "mlp", "--workers", "4", "--step-time", "1", "--link-rate", "1gbit", "--strategies", "ps-async"],
     "cannot be predicted"),
    (["--model", "mlp", "--workers", "4", "--step-time", "1", "--link-rate", "1gbit", "--procs-per-node", "3"],
     "--procs-per-node"),
    (["--model", "mlp", "--workers", "4", "--step-time", "1", "--calibration", "/nonexistent.json"], "no such file"),
    (["--model", "mlp", "--data", "svhn", "--workers", "4", "--step-time", "1", "--link-rate", "1gbit"], "--data"),
    # issue 32: --top -1 printed every row but the last; --top 0 meant all: at least 1 now, left out for all
    (["--model", "mlp", "--workers", "4", "--step-time", "1", "--link-rate", "1gbit", "--top", "-1"], "--top must be"),
    (["--model", "mlp", "--workers", "4", "--step-time", "1", "--link-rate", "1gbit", "--top", "0"], "--top must be"),
    # issue 32: an absurd latency or calibration predicted inf (or 1e299 ms) and still named a first choice
    (["--model", "mlp", "--workers", "4", "--step-time", "1", "--link-rate", "1gbit", "--latency", "1e300"],
     "--latency: '1e300' is more than 60 s"),
    (["--model", "mlp", "--workers", "4", "--step-time", "1e9", "--link-rate", "1gbit"], "--step-time"),
    (["--params", "1e15", "--workers", "4", "--step-time", "1", "--link-rate", "1gbit"], "--params: must be at most"),
    (["--params", "1.5", "--workers", "4", "--step-time", "1", "--link-rate", "1gbit"], "not a whole number"),
])
def test_bad_input_is_one_clear_error(argv, phrase, capsys):
    assert cli.main(["advise", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and phrase in errors[0], err


def test_measure_times_the_model_here(capsys):
    argv = [a for a in BASE if a not in ("--step-time", "20ms")]
    assert cli.main([*argv, "--measure", "--host-cores", "2", "--ranks-per-host", "4", "--json", "-"]) == 0
    advice = json.loads(capsys.readouterr().out)
    assert advice["workload"]["compute_s"] > 0
    assert advice["network"]["cpu_factor"] == 2.0          # 4 ranks on 2 cores, work timed on one thread
    assert "measured here" in advice["inputs"]["compute_s_source"]


def test_codec_times_measured_elsewhere_are_used_as_they_are(tmp_path, capsys):
    times = tmp_path / "codec.json"
    times.write_text(json.dumps({"codec_s": {"fp16": 0.25}}))
    assert cli.main([*BASE, "--codec-times", str(times), "--host-cores", "2", "--ranks-per-host", "4",
                     "--json", "-"]) == 0
    advice = json.loads(capsys.readouterr().out)
    assert advice["network"]["cpu_factor"] == 1.0
    assert next(r for r in advice["ranked"] if r["label"] == "ring fp16")["codec_s"] == 0.25
    times.write_text(json.dumps({"codec_s": {"bf16": 0.25}}))
    assert cli.main([*BASE, "--codec-times", str(times)]) == 2
    assert "no time for fp16" in capsys.readouterr().err


def test_calibration_without_alpha_is_refused(tmp_path, capsys):
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"something": 1}))
    assert cli.main(["advise", "--model", "mlp", "--workers", "4", "--step-time", "1", "--calibration", str(cal)]) == 2
    assert "no alpha_s and beta_s_per_byte" in capsys.readouterr().err


def test_the_command_exits_with_one_line_in_a_process():
    assert_one_clear_error(ddtrain("advise", "--model", "mlp", "--workers", "4", "--step-time", "-1",
                                   "--link-rate", "1gbit", timeout=120), "--step-time")


@pytest.mark.parametrize("beta, phrase", [(1e300, "below 1 kbit/s"), (0.5, "below 1 kbit/s")])
def test_a_near_zero_bandwidth_calibration_is_refused(tmp_path, capsys, beta, phrase):
    # issue 32: beta 1e300 s/B predicted `inf` ms per step for every method and still named a first choice
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"alpha_s": 1e-4, "beta_s_per_byte": beta}))
    assert cli.main(["advise", "--params", "1000000", "--workers", "4", "--step-time", "0.4",
                     "--calibration", str(cal)]) == 2
    err = capsys.readouterr().err
    assert phrase in err and "first choice" not in err


def test_a_trillion_parameters_are_predicted_without_allocating_them(capsys):
    # issue 32: `advise --params 1e12` timed the codecs on a 4 TB buffer (RuntimeError: can't allocate memory);
    # the codecs are timed on a 16 M-element sample and scaled, and 1e12 reads as the whole number it is
    assert cli.main(["advise", "--params", "1e12", "--workers", "4", "--step-time", "0.4", "--link-rate", "1gbit",
                     "--compressions", "none,fp16", "--sync-every", "4", "--json", "-"]) == 0
    advice = json.loads(capsys.readouterr().out)
    assert advice["workload"]["params"] == 10 ** 12
    assert "on a sample of" in advice["inputs"]["codec_s_source"]
    assert advice["network"]["codec_s"]["fp16"] > 0


def test_sample_shapes_keep_the_mix_and_scale_back():
    from ddtrain.bench.measure import sample_shapes
    shapes = ((1_000_000, 1_000_000), (10,))
    sample, factor = sample_shapes(shapes, most=1000)
    total = sum(a * (b if len(s) > 1 else 1) for s in sample for a, b in [(s[0], s[-1])])
    assert total <= 1000 and factor * total == pytest.approx(10 ** 12 + 10)
    assert sample_shapes(((3, 4),), most=1000) == (((3, 4),), 1.0)


def _existing_file(folder):
    (folder / "advice.json").write_text("mine\n")
    return folder / "advice.json"


def _under_a_file(folder):
    (folder / "f").write_text("x")
    return folder / "f" / "advice.json"


@pytest.mark.parametrize("make, phrase", [
    (_existing_file, "the file exists; give --force"),
    (lambda folder: folder, "is a directory"),
    (_under_a_file, "is not a directory"),
])
def test_the_json_output_is_checked_before_anything_runs(tmp_path, capsys, make, phrase):
    # issue 32: an existing file where advise writes was a traceback (a directory, a parent that is a file) or
    # silently replaced (a file)
    target = make(tmp_path)
    before = target.read_text() if target.is_file() else None
    assert cli.main([*BASE, "--json", str(target)]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and phrase in errors[0] and "Traceback" not in err, err
    if before is not None:
        assert target.read_text() == before
        assert cli.main([*BASE, "--json", str(target), "--force"]) == 0
        assert json.loads(target.read_text())["first_choice"]

"""A superscript digit in an integer flag (issue 32): `'²'.isdigit()` is True but `int('²')` raises, so `--nproc ²`
was `ddtrain: error: ValueError: invalid literal for int()` (a masked traceback). Every integer flag of every command
now answers with one line naming the flag."""
import pytest

from ddtrain import cli


@pytest.mark.parametrize("argv, flag", [
    (["train", "--model", "mlp", "--data", "digits", "--nproc", "²"], "--nproc"),
    (["train", "--model", "mlp", "--data", "digits", "--nproc", "1:²"], "--nproc"),
    (["train", "--model", "mlp", "--data", "digits", "--nnodes", "²"], "--nnodes"),
    (["train", "--model", "mlp", "--data", "digits", "--epochs", "²"], "--epochs"),
    (["train", "--model", "mlp", "--data", "digits", "--checkpoint-every", "²"], "--checkpoint-every"),
    (["run", "--nproc", "²", "script.py"], "--nproc"),
    (["bench", "scaling", "--out", "{tmp}", "--sync-every", "²"], "--sync-every"),
    (["bench", "scaling", "--out", "{tmp}", "--workers", "1,²"], "--workers"),
    (["demo", "--workers", "²", "--out", "{tmp}"], "--workers"),
    (["demo", "--epochs", "²", "--out", "{tmp}"], "--epochs"),
    (["advise", "--params", "²", "--workers", "4", "--step-time", "1", "--link-rate", "1gbit"], "--params"),
    (["advise", "--model", "mlp", "--workers", "²", "--step-time", "1", "--link-rate", "1gbit"], "--workers"),
])
def test_a_superscript_digit_is_one_line_naming_the_flag(argv, flag, tmp_path, capsys, monkeypatch):
    from ddtrain.distributed import launch
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(launch, "run_local", lambda *a, **k: pytest.fail("workers were started"))
    argv = [a.replace("{tmp}", str(tmp_path / "out")) for a in argv]
    try:
        code = cli.main(argv)
    except SystemExit as exit_:   # argparse's own error: `ddtrain train: error: argument --epochs: invalid int value`
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and flag in errors[0], err
    assert "ValueError" not in err and "Traceback" not in err, err

"""Sharded strategies resume at another worker count: zero2 (and zero1, fsdp) checkpointed on 2 workers, resumed on 3.

The checkpoint holds the whole model's optimizer state gathered from the shards (ddp's layout), so
the 3-worker run cuts it anew; with --global-batch-size 96 its parameters must equal (rtol 1e-5)
the uninterrupted 2-worker run's (``test_elastic_resume.run_matrix``, SGD with momentum: a lost or
mis-cut momentum buffer fails it).
"""
import pytest

from test_elastic_resume import run_matrix


def test_zero2_resumes_on_3_workers_as_the_uninterrupted_2_worker_run(tmp_path):
    run_matrix("zero2", tmp_path, sizes=(3,))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero1", "fsdp"])
def test_zero1_and_fsdp_resume_on_3_workers_as_the_uninterrupted_run(strategy, tmp_path):
    run_matrix(strategy, tmp_path, sizes=(3,))

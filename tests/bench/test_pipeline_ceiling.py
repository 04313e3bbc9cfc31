"""pagoda.bench.pipeline_ceiling: a stack with the synthetic worker serves every request
in full (async scheduling on and off), and the synthetic runner checks the deltas."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagoda.bench import pipeline_ceiling
from pagoda.bench.synthetic_worker import SyntheticRunner
from shared.protocol import NewRequest, RunningRequest, StepBatch
from shared.sampling_params import SamplingParams


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_every_request_is_served_in_full(tiny_smollm_dir: Path, async_scheduling: bool) -> None:
    flag = "--async-scheduling" if async_scheduling else "--no-async-scheduling"
    args = pipeline_ceiling.build_parser().parse_args([
        "--model", str(tiny_smollm_dir), "--num-requests", "12", "--prompt-len", "8,24",
        "--output-len", "fixed:20", "--max-concurrency", "4", "--frontends", "1",
        "--step-ms", "1", "--no-progress", flag])
    report = pipeline_ceiling.run(args)
    assert report["failed"] == 0 and report["output_tokens"] == 12 * 20
    assert report["async_scheduling"] is async_scheduling
    # 12 requests of 20 tokens, 4 at a time: at least 3 x 20 steps were run
    assert report["steps"] >= 60 and report["worker_busy_share"] > 0
    assert set(report["cpu_s"]) >= {"worker", "scheduler", "frontends", "client"}
    pipeline_ceiling.print_report(report)


def test_synthetic_runner_samples_the_prompt_cyclically_and_checks_the_steps() -> None:
    runner = SyntheticRunner()
    new = NewRequest(request_id=3, token_ids=[10, 11, 12], num_prompt_tokens=3,
                     sampling_params=SamplingParams(), block_ids=[0], num_computed_tokens=0)
    out = runner.execute(StepBatch(step_id=0, new_requests=[new], scheduled_request_ids=[3],
                                   num_scheduled_tokens=[3]))
    assert out.request_ids == [3] and out.sampled_token_ids == [10]
    out = runner.execute(StepBatch(step_id=1, running_requests=[RunningRequest(3, [1])],
                                   scheduled_request_ids=[3], num_scheduled_tokens=[1]))
    assert out.sampled_token_ids == [11]
    with pytest.raises(RuntimeError, match="past its known tokens"):
        runner.execute(StepBatch(step_id=2, scheduled_request_ids=[3], num_scheduled_tokens=[2]))

"""torchrun's merged output: what reaches the console, and the one line that reports a failure."""

from __future__ import annotations

from runner.torchrun_output import TorchrunOutput

# The tail of torchrun's ChildFailedError dump when local rank 1 (global rank 5) failed first.
DUMP = """\
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
megamoe.train FAILED
------------------------------------------------------------
Failures:
[0]:
  rank      : 4 (local_rank: 0)
  exitcode  : -15 (pid: 3232)
------------------------------------------------------------
Root Cause (first observed failure):
[1]:
  time      : 2026-12-01_22:34:01
  host      : node2
  rank      : 5 (local_rank: 1)
  exitcode  : 3 (pid: 3231)
  error_file: <N/A>
============================================================
"""


def _feed(out: TorchrunOutput, text: str) -> list[str]:
    return [line for line in text.splitlines(keepends=True) if out.to_console(line)]


def test_torchrun_output_own_lines_stay_in_the_log_unless_debug() -> None:
    banner = "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default\n"
    assert _feed(TorchrunOutput({0}, show_agent=False), banner + DUMP) == []
    assert _feed(TorchrunOutput({0}, show_agent=True), banner) == [banner]


def test_torchrun_output_console_shows_only_the_chosen_ranks() -> None:
    out = TorchrunOutput({0, 3}, show_agent=False)
    shown = _feed(out, "[default0]:a\n[default1]:b\n[default3]:c\n")
    assert shown == ["[default0]:a\n", "[default3]:c\n"]


def test_torchrun_output_a_line_every_rank_prints_reaches_the_console_once() -> None:
    out = TorchrunOutput(None, show_agent=False)
    text = "[default1]:Traceback\n[default1]:ValueError: no data\n[default0]:Traceback\n[default0]:ValueError: no data\n"
    assert _feed(out, text) == ["[default1]:Traceback\n", "[default1]:ValueError: no data\n"]
    assert _feed(out, "[default0]:step 2\n[default0]:step 2\n") == [
        "[default0]:step 2\n",
        "[default0]:step 2\n",
    ]


def test_torchrun_output_summary_names_the_first_failure_its_error_and_the_log() -> None:
    out = TorchrunOutput({0}, show_agent=False)
    _feed(
        out,
        "[default1]:Traceback (most recent call last):\n[default1]:RuntimeError: bad shard\n[default1]:\n",
    )
    _feed(out, DUMP)
    assert out.worker_exit_code() == 3
    assert out.summary(1, "/r/logs/j-node1.log") == (
        "rank 5 failed first with exit code 3: RuntimeError: bad shard (full output: /r/logs/j-node1.log)"
    )


def test_torchrun_output_summary_without_a_worker_failure_quotes_torchrun() -> None:
    out = TorchrunOutput({0}, show_agent=False)
    _feed(
        out,
        "Traceback (most recent call last):\ntorch.distributed.DistNetworkError: address already in use\n",
    )
    assert out.worker_exit_code() is None
    assert out.summary(1, "n.log") == (
        "torchrun exited with code 1: torch.distributed.DistNetworkError: address already in use (full output: n.log)"
    )


def test_torchrun_output_signal_exit_codes_read_as_a_shell_would() -> None:
    out = TorchrunOutput({0}, show_agent=False)
    _feed(out, DUMP.replace("exitcode  : 3 (pid: 3231)", "exitcode  : -9 (pid: 3231)"))
    assert out.worker_exit_code() == 137


def test_torchrun_output_reads_the_trainers_saved_line_from_any_rank() -> None:
    out = TorchrunOutput({0}, show_agent=False)
    line = (
        "[default1]:[10:00:01 rank 1] WARNING megamoe.train: preempted (SIGTERM): saved at iteration 6; "
        "run the job again to resume\n"
    )
    _feed(out, line)
    assert out.saved is not None and (out.saved.reason, out.saved.iteration) == ("preempted (SIGTERM)", 6)


def test_torchrun_output_notices_a_signal_torchrun_got_itself() -> None:
    out = TorchrunOutput({0}, show_agent=False)
    _feed(out, "[default0]:Received 15 death signal, shutting down workers\n")  # a rank's line: not torchrun
    assert not out.signalled
    _feed(out, "W1202 00:00:06.182000 2191 api.py:753] Received 15 death signal, shutting down workers\n")
    assert out.signalled

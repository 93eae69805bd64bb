"""Bad input to the task commands gets one line naming the option, never a traceback."""

from __future__ import annotations

from click.testing import CliRunner

from reservoir.cli import main


def test_a_node_offering_an_unknown_driver_is_a_usage_error_naming_driver() -> None:
    done = CliRunner().invoke(
        main, ["node", "--broker", "memory://", "--name", "n", "--vcpus", "1", "--driver", "nope"]
    )
    assert done.exit_code == 2
    assert "--driver" in done.output and "no task driver named 'nope'" in done.output
    assert "Traceback" not in done.output


def test_run_without_a_command_is_a_usage_error() -> None:
    done = CliRunner().invoke(main, ["run", "--broker", "memory://", "--vcpus", "1"])
    assert done.exit_code == 2
    assert "give the COMMAND to run (or an --image, to run its own)" in done.output


def test_run_with_a_malformed_env_is_a_usage_error_naming_it() -> None:
    done = CliRunner().invoke(
        main, ["run", "--broker", "memory://", "--vcpus", "1", "--env", "NOEQUALS", "--", "true"]
    )
    assert done.exit_code == 2
    assert "NOEQUALS" in done.output and "Traceback" not in done.output


def test_run_with_a_bad_driver_name_is_a_usage_error() -> None:
    done = CliRunner().invoke(
        main, ["run", "--broker", "memory://", "--vcpus", "1", "--driver", "Bad Name", "--", "true"]
    )
    assert done.exit_code == 2
    assert "driver" in done.output and "Traceback" not in done.output


def test_run_on_a_cluster_with_no_node_is_not_placed() -> None:
    done = CliRunner().invoke(
        main, ["run", "--broker", "memory://", "--vcpus", "1", "--timeout", "0.5", "--", "true"]
    )
    assert done.exit_code == 1
    assert "not placed" in done.output

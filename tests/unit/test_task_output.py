"""What a node keeps of a task's output, and whom it runs tasks as: the rotating files of
a stream and reading them from an offset (bytes no longer kept are said), the exit file,
the user a node's configuration names (never root unless allowed), and the ``[tasks]``
table of a node's configuration file."""

from __future__ import annotations

from pathlib import Path

import pytest

from reservoir.protocol.task_policy import TaskPolicy
from reservoir.runtime.node_config import ConfigError, load_node_file
from reservoir.runtime.task_output import read_output_dir
from reservoir.runtime.task_supervisor import (
    RotatingOutput,
    output_files,
    read_exit_file,
    reason_file,
    write_exit_file,
)
from reservoir.runtime.tasks import TaskConfig, TaskConfigError, TaskUser


def test_a_stream_keeps_at_most_its_files_each_named_after_its_first_byte(
    tmp_path: Path,
) -> None:
    output = RotatingOutput(tmp_path, "stdout", max_file_bytes=10, max_files=2)
    for number in range(7):  # 7 writes of 6 bytes: 42 bytes, files of 10
        output.write(f"line{number}\n".encode())
    output.close()
    assert output.total == 42
    assert [start for start, _ in output_files(tmp_path, "stdout")] == [30, 40]
    assert sum(path.stat().st_size for _, path in output_files(tmp_path, "stdout")) == 12


def test_reading_from_an_offset_no_longer_kept_says_how_much_was_skipped(tmp_path: Path) -> None:
    output = RotatingOutput(tmp_path, "stderr", max_file_bytes=10, max_files=2)
    output.write(b"0123456789abcdefghijKLMNOPQRSTuvw")  # 33 bytes
    output.close()
    chunk = read_output_dir(tmp_path, "stderr", 0, 1000)
    assert chunk is not None
    assert (chunk.offset, chunk.skipped, chunk.data, chunk.size) == (20, 20, b"KLMNOPQRSTuvw", 33)
    # across the boundary of two files, from an offset still kept
    chunk = read_output_dir(tmp_path, "stderr", 27, 5)
    assert chunk is not None and (chunk.data, chunk.skipped) == (b"RSTuv", 0)
    at_end = read_output_dir(tmp_path, "stderr", 33, 10)
    assert at_end is not None and (at_end.data, at_end.offset, at_end.size) == (b"", 33, 33)
    assert read_output_dir(tmp_path / "nothing", "stderr", 0, 10) is None


def test_an_exit_file_holds_the_code_alone_as_release_0_1_0_reads_it_and_why_beside_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "exit"
    assert read_exit_file(path) is None
    write_exit_file(path, 137, "out of memory (limit 64 MiB)")
    assert read_exit_file(path) == (137, "out of memory (limit 64 MiB)")
    # what release 0.1.0's exec driver does with it, a node rolled back to it
    assert int(path.read_text().strip()) == 137
    write_exit_file(path, None, "could not start /nope: No such file or directory")
    assert read_exit_file(path) == (None, "could not start /nope: No such file or directory")
    path.write_text("3\n")  # 0.1.0's own, and no reason beside it
    reason_file(path).unlink()
    assert read_exit_file(path) == (3, "")


def test_an_agent_run_as_root_runs_tasks_as_nobody_and_refuses_root_unless_allowed() -> None:
    assert TaskUser.for_config(TaskConfig(), euid=0).name == "nobody"
    assert TaskUser.for_config(TaskConfig(), euid=0).uid not in (None, 0)
    with pytest.raises(TaskConfigError, match=r"tasks\.user 'root' is root.*tasks\.allow_root"):
        TaskUser.for_config(TaskConfig(user="root"), euid=0)
    with pytest.raises(TaskConfigError, match=r"tasks\.allow_root"):
        TaskUser.for_config(TaskConfig(user="0"), euid=0)
    allowed = TaskUser.for_config(TaskConfig(user="root", allow_root=True), euid=0)
    assert allowed.uid == 0
    with pytest.raises(TaskConfigError, match=r"tasks\.user .no-such-user-here.: no such user"):
        TaskUser.for_config(TaskConfig(user="no-such-user-here"), euid=0)


def test_an_agent_not_run_as_root_runs_tasks_as_itself_and_cannot_name_another() -> None:
    own = TaskUser.for_config(TaskConfig(), euid=65534)
    assert (own.name, own.uid) == ("nobody", None)  # no switch
    with pytest.raises(TaskConfigError, match="runs as uid 65534 and cannot start tasks"):
        TaskUser.for_config(TaskConfig(user="root", allow_root=True), euid=65534)


def test_the_tasks_table_of_a_node_file_is_the_nodes_task_configuration(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text(
        'name = "n"\n[tasks]\nuser = "nobody"\ncommands = ["sh", "/opt/*"]\nenv = []\n'
        "[tasks.output]\nmax_file_kb = 64\nmax_files = 3\nretention_h = 0.5\n"
        '[tasks.docker]\nvolumes = ["/data:/data:ro"]\n'
    )
    config = load_node_file(path).tasks.task_config()
    assert config == TaskConfig(
        user="nobody",
        policy=TaskPolicy(commands=("sh", "/opt/*"), images=None, env=()),
        output_file_bytes=64 * 1024,
        output_files=3,
        retention_s=1800.0,
        docker_volumes=("/data:/data:ro",),
    )
    assert load_node_file(path).tasks.task_config(user="someone").user == "someone"
    path.write_text("[tasks]\nalow_root = true\n")
    with pytest.raises(ConfigError, match=r"line 2: tasks\.alow_root"):
        load_node_file(path)

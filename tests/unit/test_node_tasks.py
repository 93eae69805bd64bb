"""The node's side of a task's life, driven by hand on a fake clock: the machine asks for
the task to start after Accepted, hears of its end, frees its allocation, stops it when
released, and answers queries. Every test ends with the audit of the node."""

from __future__ import annotations

from typing import Any

from reservoir.protocol.audit import NodeSnapshot, audit
from reservoir.protocol.effects import (
    Bind,
    DeleteAllocation,
    Effect,
    ForgetTask,
    RememberTask,
    Send,
    StartTask,
    StopTask,
    StoreAllocation,
    Unbind,
)
from reservoir.protocol.ledger import Inventory
from reservoir.protocol.messages import (
    Accepted,
    AlreadyPlaced,
    Award,
    Decline,
    Free,
    Lookup,
    Message,
    Offer,
    ReservationRequest,
    TaskQuery,
    TaskSpec,
    TaskState,
    lookup_topic,
)
from reservoir.protocol.node import EXPIRY_TIMER, TASK_DRIVER_MISSING, NodeConfig, NodeMachine
from reservoir.protocol.task_book import EndedTask
from reservoir.protocol.task_policy import TASK_NOT_ALLOWED, TaskPolicy

T0 = 1000.0
REQUESTOR = "req-1"
REPLY = "reservoir.requestor.req-1"
TASK = TaskSpec(driver="exec", command=("sh", "-c", "exit 3"))


def a_node(drivers: frozenset[str] = frozenset({"exec"})) -> NodeMachine:
    node = NodeMachine(
        NodeConfig(
            name="node-a",
            address="reservoir.node.node-a",
            inventories={"VCPU": Inventory(total=4), "MEMORY_MB": Inventory(total=4096)},
            task_drivers=drivers,
        )
    )
    node.start(T0)
    return node


def a_request(request_id: str = "r1", **fields: Any) -> ReservationRequest:
    values: dict[str, Any] = {
        "request_id": request_id,
        "sender": REQUESTOR,
        "reply_to": REPLY,
        "resources": {"VCPU": 4, "MEMORY_MB": 1024},
        "tier": 10,
        "attempt": 1,
        "ttl_s": 5.0,
        "task": TASK,
        "probed_node": "node-a",
    }
    values.update(fields)
    return ReservationRequest(**values)


def sent(effects: list[Effect]) -> list[Message]:
    return [e.message for e in effects if isinstance(e, Send)]


def placed(node: NodeMachine, request: ReservationRequest) -> tuple[str, list[Effect]]:
    """Offer and award ``request``: its allocation id and the award's effects."""
    (offer,) = [m for m in sent(node.handle(request, T0)) if isinstance(m, Offer)]
    effects = node.handle(
        Award(
            request_id=offer.request_id,
            sender=REQUESTOR,
            reply_to=REPLY,
            reservation_id=offer.reservation_id,
            slots=1,
        ),
        T0 + 0.01,
    )
    (allocation_id,) = list(node.ledger.allocations)
    return allocation_id, effects


def audited(node: NodeMachine) -> None:
    node.on_timer(EXPIRY_TIMER, T0 + 10)  # what was only reserved has expired by then
    snapshot = NodeSnapshot.of(node.name, node.ledger, T0 + 10, node.tier(), node.task_violations())
    audit([snapshot]).raise_if_failed()


def test_the_task_starts_after_the_allocation_is_stored_and_accepted() -> None:
    node = a_node()
    allocation_id, effects = placed(node, a_request())
    kinds = [type(e).__name__ for e in effects if not isinstance(e, Send)] + [
        type(m).__name__ for m in sent(effects)
    ]
    store = next(i for i, e in enumerate(effects) if isinstance(e, StoreAllocation))
    accepted = next(
        i for i, e in enumerate(effects) if isinstance(e, Send) and isinstance(e.message, Accepted)
    )
    start = next(i for i, e in enumerate(effects) if isinstance(e, StartTask))
    assert store < accepted < start, kinds
    assert effects[start].allocation.task == TASK  # type: ignore[union-attr]
    assert node.tasks.get(allocation_id) is not None
    audited(node)


def test_a_task_that_exits_frees_its_allocation_and_tells_the_requestor_its_code() -> None:
    node = a_node()
    allocation_id, _ = placed(node, a_request())
    started = node.task_changed(allocation_id, "started", T0 + 0.1, limits="rlimit")
    assert [m.state for m in sent(started) if isinstance(m, TaskState)] == ["started"]
    ended = node.task_changed(allocation_id, "exited", T0 + 1, exit_code=3)
    (state,) = [m for m in sent(ended) if isinstance(m, TaskState)]
    assert (state.state, state.exit_code, state.limits) == ("exited", 3, "rlimit")
    told = [e.address for e in ended if isinstance(e, Send) and isinstance(e.message, TaskState)]
    assert told == [REPLY]
    assert DeleteAllocation(allocation_id) in ended
    assert node.ledger.allocations == {}
    # the room is back: the same request fits again
    assert [m for m in sent(node.handle(a_request("r2"), T0 + 2)) if isinstance(m, Offer)]
    audited(node)


def test_a_kept_allocation_outlives_its_task() -> None:
    node = a_node()
    kept = TaskSpec(driver="exec", command=("true",), keep_allocation=True)
    allocation_id, _ = placed(node, a_request(task=kept))
    node.task_changed(allocation_id, "started", T0 + 0.1)
    ended = node.task_changed(allocation_id, "exited", T0 + 1, exit_code=0)
    assert not any(isinstance(e, DeleteAllocation) for e in ended)
    assert allocation_id in node.ledger.allocations
    audited(node)


def test_a_task_that_fails_to_start_frees_its_allocation_with_the_reason() -> None:
    node = a_node()
    allocation_id, _ = placed(node, a_request())
    effects = node.task_changed(allocation_id, "failed", T0 + 0.1, reason="command not found")
    (state,) = [m for m in sent(effects) if isinstance(m, TaskState)]
    assert (state.state, state.reason) == ("failed", "command not found")
    assert node.ledger.allocations == {}
    audited(node)


def test_freeing_an_allocation_whose_task_runs_stops_it_with_the_requests_grace() -> None:
    node = a_node()
    allocation_id, _ = placed(node, a_request(task=TaskSpec(driver="exec", command=("sleep", "9"),
                                                           stop_grace_s=2.5)))  # fmt: skip
    node.task_changed(allocation_id, "started", T0 + 0.1)
    freed = node.handle(Free(request_id="r1", sender=REQUESTOR, reply_to=REPLY), T0 + 1)
    assert StopTask(allocation_id, "exec", 2.5) in freed
    audited(node)  # being stopped, without its allocation: not a violation
    ended = node.task_changed(allocation_id, "exited", T0 + 1.5, exit_code=143)
    (state,) = [m for m in sent(ended) if isinstance(m, TaskState)]
    assert (state.state, state.exit_code, state.reason) == ("stopped", 143, "released")
    audited(node)


def test_a_node_without_the_driver_declines_with_the_reason() -> None:
    node = a_node(drivers=frozenset())
    effects = node.handle(a_request(explain=True), T0)
    (decline,) = [m for m in sent(effects) if isinstance(m, Decline)]
    assert not [m for m in sent(effects) if isinstance(m, Offer)]
    assert [(r.code, r.subject) for r in decline.reasons] == [(TASK_DRIVER_MISSING, "exec")]
    assert node.ledger.reservations == {}
    audited(node)


def test_a_query_hears_of_running_and_ended_tasks() -> None:
    node = a_node()
    allocation_id, _ = placed(node, a_request(resources={"VCPU": 1}))
    node.task_changed(allocation_id, "started", T0 + 0.1)
    ask = TaskQuery(request_id="r1", sender="asker", reply_to="reservoir.requestor.asker")
    (running,) = sent(node.handle(ask, T0 + 0.2))
    assert isinstance(running, TaskState)
    assert (running.state, running.answering) == ("running", True)
    node.task_changed(allocation_id, "exited", T0 + 1, exit_code=0)
    every = TaskQuery(request_id="tasks", sender="asker", reply_to="x", every=True)
    (ended,) = sent(node.handle(every, T0 + 2))
    assert isinstance(ended, TaskState)
    assert (ended.state, ended.exit_code, ended.request_id) == ("exited", 0, "r1")
    assert sent(node.handle(TaskQuery(request_id="other", sender="a", reply_to="x"), T0 + 3)) == []
    audited(node)


def test_the_audit_names_an_allocation_still_held_after_its_task_ended() -> None:
    node = a_node()
    allocation_id, _ = placed(node, a_request())
    node.task_changed(allocation_id, "started", T0 + 0.1)
    node.tasks.change(
        node.tasks.get(allocation_id),  # type: ignore[arg-type]
        "exited",
        exit_code=0,
        reason="",
        limits=None,
    )  # as if the machine had forgotten to free it
    assert node.task_violations() == [
        f"the task of {allocation_id} ended (exited) and its allocation is still held"
    ]


def test_after_a_restart_a_held_allocations_task_is_known_again_from_its_driver() -> None:
    node = a_node()
    allocation_id, _ = placed(node, a_request())
    again = NodeMachine(node.config, allocations=list(node.ledger.allocations.values()))
    again.start(T0 + 5)
    effects = again.task_changed(allocation_id, "exited", T0 + 6, exit_code=7)
    (state,) = [m for m in sent(effects) if isinstance(m, TaskState)]
    assert (state.state, state.exit_code) == ("exited", 7)
    assert again.ledger.allocations == {}
    audited(again)


def test_a_probed_node_without_the_driver_says_so_even_unasked_to_explain() -> None:
    node = a_node(drivers=frozenset())
    effects = node.handle(a_request(explain=False), T0)
    (decline,) = [m for m in sent(effects) if isinstance(m, Decline)]
    assert [(r.code, r.subject) for r in decline.reasons] == [(TASK_DRIVER_MISSING, "exec")]
    audited(node)


def a_node_with(policy: TaskPolicy) -> NodeMachine:
    node = NodeMachine(
        NodeConfig(
            name="node-a",
            address="reservoir.node.node-a",
            inventories={"VCPU": Inventory(total=4), "MEMORY_MB": Inventory(total=4096)},
            task_drivers=frozenset({"exec", "docker"}),
            task_policy=policy,
        )
    )
    node.start(T0)
    return node


def test_a_task_the_nodes_policy_refuses_is_declined_with_what_it_refuses() -> None:
    node = a_node_with(TaskPolicy(commands=("sh", "/opt/jobs/*"), images=("alpine:*",),
                                  env=("LANG",)))  # fmt: skip
    refused = {
        "command": TaskSpec(driver="exec", command=("python3", "-c", "1")),
        "image": TaskSpec(driver="docker", image="debian:12"),
        "env": TaskSpec(driver="exec", command=("sh",), env={"LANG": "C", "LD_PRELOAD": "x"}),
    }
    for subject, task in refused.items():
        effects = node.handle(a_request(f"r-{subject}", task=task), T0)
        (decline,) = [m for m in sent(effects) if isinstance(m, Decline)]
        (reason,) = decline.reasons
        assert (reason.code, reason.subject) == (TASK_NOT_ALLOWED, subject)
    (again,) = [m for m in sent(node.handle(a_request("r-2", task=refused["command"]), T0))
                if isinstance(m, Decline)]  # fmt: skip
    assert again.reasons[0].detail == "the command 'python3' is not allowed"
    allowed = TaskSpec(driver="exec", command=("/opt/jobs/nightly",), env={"LANG": "C"})
    assert [m for m in sent(node.handle(a_request("r-ok", task=allowed), T0)) if
            isinstance(m, Offer)]  # fmt: skip
    audited(node)


def test_an_ended_task_is_remembered_until_its_retention_passes_then_let_go() -> None:
    node = a_node()
    allocation_id, awarded = placed(node, a_request(findable_when_placed=True))
    topic = lookup_topic("r1")
    assert Bind(topic) in awarded  # found by id while anything of it is held or remembered
    node.task_changed(allocation_id, "started", T0 + 0.1, wall_s=5000.0)
    ended = node.task_changed(allocation_id, "exited", T0 + 1, exit_code=3, wall_s=5001.0)
    (kept,) = [e for e in ended if isinstance(e, RememberTask)]
    assert (kept.task.allocation_id, kept.task.exit_code, kept.task.ended_at_s) == (
        allocation_id, 3, 5001.0)  # fmt: skip
    assert Unbind(topic) not in ended  # its task is remembered
    assert node.forget_ended_tasks(before_s=5001.0) == []  # not yet past
    forgotten = node.forget_ended_tasks(before_s=5001.5)
    assert ForgetTask(allocation_id, "exec") in forgotten
    assert Unbind(topic) in forgotten  # nothing of the id is held or remembered any more
    assert node.tasks.get(allocation_id) is None
    audited(node)


def test_a_node_started_with_the_tasks_it_kept_tells_of_them_and_finds_them_by_id() -> None:
    kept = EndedTask(allocation_id="node-a.x.1/0", request_id="r9", driver="exec",
                     state="exited", exit_code=5, ended_at_s=100.0)  # fmt: skip
    node = NodeMachine(a_node().config, ended_tasks=[kept])
    started = node.start(T0)
    assert Bind(lookup_topic("r9")) in started
    ask = TaskQuery(request_id="r9", sender="asker", reply_to="reservoir.requestor.asker")
    (state,) = sent(node.handle(ask, T0 + 1))
    assert isinstance(state, TaskState)
    assert (state.state, state.exit_code) == ("exited", 5)
    lookup = Lookup(request_id="r9", sender="asker", reply_to="x", following=True)
    (placed_answer,) = sent(node.handle(lookup, T0 + 2))
    assert isinstance(placed_answer, AlreadyPlaced)
    assert [(t.allocation_id, t.exit_code) for t in placed_answer.tasks] == [("node-a.x.1/0", 5)]
    audited(node)

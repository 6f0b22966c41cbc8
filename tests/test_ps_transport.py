"""The parameter-server transport's start-up, in one process."""

from __future__ import annotations

from torch_distribute.cluster.launcher import free_ports
from torch_distribute.ps import transport


def test_a_task_registering_the_moment_the_chief_listens_is_answered(monkeypatch):
    """The chief's entry points find its node as soon as its server accepts calls: a worker
    forked by a forkserver (it starts fast) registered inside that window and was told "this task
    is not the chief"."""
    answers = []
    serve = transport._Node.serve

    def serve_then_take_a_registration(node, address):
        serve(node, address)
        answers.append(transport._register("worker:0"))  # what the server runs for a caller

    monkeypatch.setattr(transport._Node, "serve", serve_then_take_a_registration)
    monkeypatch.setenv("TD_JOB_SECRET", "s" * 64)
    (port,) = free_ports(1)
    try:
        transport.join("chief", 0, ("127.0.0.1", port), rpc_timeout=5, startup_timeout=5,
                       addresses={"chief:0": ("127.0.0.1", port)})
    finally:
        transport.leave()
    assert answers == ["worker:0"]

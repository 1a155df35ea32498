"""The decode step's graph cache (engine.graphs.StepGraphs) at its cap.

Skipped without a CUDA device (CI): graphs are captured on GPUs only.
"""

from __future__ import annotations

import pytest
import torch

from engine import graphs as graphs_mod
from engine.graphs import StepGraphs, is_graph_output

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def capped(monkeypatch):
    monkeypatch.setattr(graphs_mod, "MAX_GRAPHS", 2)
    graphs = StepGraphs(enabled=True)
    x = torch.arange(4.0, device="cuda").view(1, 4)

    def step(factors):
        graphs.step_begins()
        out = [graphs.run(("times", k), lambda t, k=k: t * k, x) for k in factors]
        assert all(torch.equal(o, x * k) for k, o in zip(factors, out))

    return graphs, step


def test_after_a_step_met_the_cap_the_next_one_starts_afresh(capped):
    """Graphs captured for buffers since replaced (a grown state, another context bucket)
    never replay again. A step that needs a new one past the cap runs it eagerly; the
    next step drops every graph and recaptures what it replays: decode never stays
    eager for good."""
    graphs, step = capped
    step([1, 2])  # two graphs: the cap
    step([3])  # a new piece (the state grew): eager
    assert graphs.captures == 2 and graphs.resets == 0
    step([3])
    assert graphs.resets == 1 and graphs.captures == 3
    replays = graphs.replays
    step([3])
    assert graphs.resets == 1 and graphs.captures == 3 and graphs.replays == replays + 1


def test_a_step_of_more_pieces_than_the_cap_keeps_its_graphs(capped):
    """Recapturing every step would cost more than running the excess eagerly."""
    graphs, step = capped
    for _ in range(3):
        step([1, 2, 3])
    assert graphs.captures == 2 and graphs.resets == 0


def test_a_graph_reads_another_graphs_output_in_place():
    """An argument that is a captured graph's output buffer (of any StepGraphs) is read by
    the consumer's graph in place, not copied into an input buffer of its own; a CPU
    argument is copied up before each replay. Each replay sees the values of that step."""
    producer, consumer = StepGraphs(enabled=True), StepGraphs(enabled=True)
    x = torch.zeros((1, 4), device="cuda")
    for step in range(3):
        x.copy_(torch.arange(4.0) + step)
        doubled = producer.run("double", lambda t: t * 2, x)
        host = torch.full((1, 4), float(step))  # a new CPU tensor each step
        out = consumer.run("add", lambda a, b: a + b, doubled, host)
        assert torch.equal(out.cpu(), ((torch.arange(4.0) + step) * 2 + step).view(1, 4))
    (_graph, inputs, _outputs), = consumer._graphs.values()
    assert inputs[0] is doubled and inputs[1].is_cuda  # in place; the CPU one has a device buffer
    assert consumer.captures == 1 and consumer.replays == 3


def test_a_consumer_of_a_recaptured_graph_is_captured_again():
    """The producer's graphs dropped and captured again (new output buffers): the consumer
    must not replay its graph of the old buffer (which it holds until then, so no other
    tensor can take its id); it captures one of the new, and drops the old one, which
    could never replay again."""
    producer, consumer = StepGraphs(enabled=True), StepGraphs(enabled=True)
    x = torch.ones((1, 4), device="cuda")
    first = producer.run("triple", lambda t: t * 3, x)
    assert torch.equal(consumer.run("neg", lambda t: -t, first).cpu(), -3 * torch.ones(1, 4))
    producer.reset()
    x.fill_(2.0)
    second = producer.run("triple", lambda t: t * 3, x)
    assert second is not first
    assert torch.equal(consumer.run("neg", lambda t: -t, second).cpu(), -6 * torch.ones(1, 4))
    assert consumer.captures == 2 and len(consumer._graphs) == 1


def test_staged_step_inputs_are_read_in_place_by_every_piece():
    """The inputs a step's pieces share go into buffers of the StepGraphs once a step
    (a CPU one copied up), and every graph reads them there: no copy per piece."""
    graphs = StepGraphs(enabled=True)
    device = torch.device("cuda")
    for step in range(3):
        token, pos = graphs.staged(device, torch.tensor([7 + step], device="cuda"), torch.full((1,), step))
        a = graphs.run("a", lambda t, p: t * 10 + p, token, pos)
        b = graphs.run("b", lambda t, p, x: x - t + p, token, pos, a)
        assert a.item() == (7 + step) * 10 + step and b.item() == (7 + step) * 9 + 2 * step
    for _graph, inputs, _outputs in graphs._graphs.values():
        assert inputs[0] is token and inputs[1] is pos  # the staged buffers themselves
    assert graphs.captures == 2 and graphs.replays == 6
    graphs.stage_inputs = False  # as given (A/B runs): the graphs copy them in again
    token2, pos2 = graphs.staged(device, torch.tensor([1], device="cuda"), torch.full((1,), 0))
    assert not is_graph_output(token2) and pos2.is_cuda
    assert graphs.run("a", lambda t, p: t * 10 + p, token2, pos2).item() == 10
    copied = [inputs for key, (_g, inputs, _o) in graphs._graphs.items() if key[0] == "a" and inputs[0] is not token]
    assert len(copied) == 1 and copied[0][0] is not token2  # copied into the graph's own input

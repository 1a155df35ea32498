"""The decode step's graph cache (engine.models.graphs.StepGraphs) at its cap.

Skipped without a CUDA device (CI): graphs are captured on GPUs only.
"""

from __future__ import annotations

import pytest
import torch

from engine.models import graphs as graphs_mod
from engine.models.graphs import StepGraphs

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

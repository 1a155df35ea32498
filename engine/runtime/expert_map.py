"""A read-only picture of an `ExpertCache`: where each expert sits and its recent use.

The GUI's heat map asks for it about once a second, from the GUI thread, so reading
must never wait on the engine: the cache's lock is tried for a few milliseconds only
(None if the engine holds it longer; the next refresh tries again), and under it only
the device tier's keys and the policy's count table are copied; the rest (thousands
of keys for a real model) is computed outside it.
"""

from __future__ import annotations

import numpy as np

from engine.service_events import PLACE_DEVICE, PLACE_RAM, ExpertMap
from expertpack import PackManifest

from .host_tier import HostTier
from .slots import READY, SlotPlanner

LOCK_TIMEOUT_S = 0.005


def read_expert_map(manifest: PackManifest, planner: SlotPlanner, host: HostTier, device: str,
                    lock_timeout_s: float = LOCK_TIMEOUT_S) -> ExpertMap | None:
    """The `ExpertMap` of a cache's parts now, or None when its lock stayed taken."""
    if not planner.cond.acquire(timeout=lock_timeout_s):
        return None
    try:
        on_device = [key for key, slot in planner.where.items() if slot.state == READY]
        log_counts = getattr(planner.policy, "log_counts", None)  # the "lru" policy keeps no counts
        counts = log_counts() if log_counts is not None else ({}, 0.0)
    finally:
        planner.cond.release()
    in_ram = host.resident_keys() if host.enabled else set()
    layers, experts = manifest.num_layers, manifest.num_experts
    places = np.zeros((layers, experts), dtype=np.uint8)
    for keys, place in ((in_ram, PLACE_RAM), (on_device, PLACE_DEVICE)):  # the device tier wins a race
        if keys:
            rows, cols = np.array(list(keys), dtype=np.int64).reshape(-1, 2).T
            places[rows, cols] = place
    uses = np.zeros((layers, experts), dtype=np.float64)
    scores, decay = counts
    if scores:
        index = np.array(list(scores.keys()), dtype=np.int64).reshape(-1, 2)
        values = np.fromiter(scores.values(), dtype=np.float64, count=len(scores))
        uses[index[:, 0], index[:, 1]] = np.exp2(values - decay)
    return ExpertMap(
        blocks=tuple(layer.block for layer in manifest.layers), num_experts=experts,
        places=places.tobytes(), uses=tuple(uses.ravel().tolist()), device=device,
    )

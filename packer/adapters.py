"""Architecture adapters: which source tensors are routed experts, and in which role order.

A GGUF stores the routed experts of block N stacked, experts outermost:
`blk.N.ffn_gate_exps.weight` of numpy shape (n_expert, rows, cols), so expert e of a
role is one contiguous byte range. The adapter finds those tensors, checks them
against the metadata (expert count, top-k, the layers that must or must not be MoE)
and returns a plan the builder copies from. Anything it does not recognise is
refused with a message naming the tensor: guessing at a layout would produce a pack
that runs the wrong math.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, overload

from expertpack import LayerEntry, RoleEntry, role_offsets
from packer.errors import PackBuildError
from packer.limits import ARCH_COUNT_LIMITS, LIMITS_DOC

# Weight roles in block order; biases follow the weights, same order.
_ROLE_ORDER = ("gate_up", "gate", "up", "down")
_EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(gate_up|gate|up|down)_exps\.(weight|bias)$")
_BLOCK = re.compile(r"^blk\.(\d+)\.")


class UnsupportedLayoutError(PackBuildError):
    """The source's expert tensors do not follow a layout this packer knows."""


class TensorLike(Protocol):
    """What the adapters need of a source tensor (packer.gguf_source.TensorInfo)."""

    name: str
    ggml_type: int
    type_name: str
    shape: tuple[int, ...]
    nbytes: int


class SourceLike(Protocol):
    """What the adapters need of a source model (packer.gguf_source.GGUFSource)."""

    # Read-only (properties), so that a source holding a dict or a dict subclass fits.
    @property
    def metadata(self) -> Mapping[str, Any]: ...

    @property
    def tensors(self) -> Mapping[str, Any]: ...

    @property
    def architecture(self) -> str: ...


@dataclass(frozen=True)
class RolePlan:
    """One role of one MoE layer: the stacked source tensor and one expert's slice of it."""

    name: str
    tensor: Any  # TensorInfo of the stacked tensor
    nbytes: int  # bytes of one expert's slice
    shape: tuple[int, ...]  # numpy-order shape of one expert's slice

    def source_offset(self, expert: int) -> int:
        """Absolute byte offset of expert `expert`'s slice in the tensor's source file."""
        return self.tensor.offset + expert * self.nbytes


@dataclass(frozen=True)
class LayerPlan:
    """The routed experts of model block `block`, roles in pack order."""

    block: int
    roles: tuple[RolePlan, ...]

    def entry(self) -> LayerEntry:
        """The manifest entry of this layer: every role at an aligned offset in the block."""
        offsets = role_offsets([r.nbytes for r in self.roles])
        return LayerEntry(
            block=self.block,
            roles=tuple(
                RoleEntry(
                    name=r.name,
                    tensor=r.tensor.name,
                    offset=off,
                    nbytes=r.nbytes,
                    ggml_type=int(r.tensor.ggml_type),
                    type_name=str(r.tensor.type_name),
                    shape=tuple(int(d) for d in r.shape),
                )
                for r, off in zip(self.roles, offsets)
            ),
        )


@dataclass(frozen=True)
class ExpertPlan:
    """Everything the builder needs to know about the source's routed experts."""

    architecture: str
    num_experts: int
    expert_used_count: int
    layers: tuple[LayerPlan, ...]

    @property
    def expert_tensor_names(self) -> frozenset[str]:
        """Names of the stacked tensors that go into experts.bin (all others go to dense.gguf)."""
        return frozenset(r.tensor.name for layer in self.layers for r in layer.roles)

    @property
    def role_names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.layers[0].roles)

    def layer_entries(self) -> tuple[LayerEntry, ...]:
        return tuple(layer.entry() for layer in self.layers)


def _refuse(problem: str,
            fix: str = "use a GGUF converted by llama.cpp's convert_hf_to_gguf.py for this model",
            ) -> UnsupportedLayoutError:
    return UnsupportedLayoutError(f"{problem}; the packer will not guess at a layout ({fix})")


@overload
def _meta_int(meta: Mapping[str, Any], key: str, *, required: Literal[True] = ...) -> int: ...
@overload
def _meta_int(meta: Mapping[str, Any], key: str, *, required: bool) -> int | None: ...
def _meta_int(meta: Mapping[str, Any], key: str, *, required: bool = True) -> int | None:
    value = meta.get(key)
    if value is None:
        if required:
            raise _refuse(f"metadata key {key} is missing")
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            value = int(value)
        except (TypeError, ValueError, OverflowError):
            raise _refuse(f"metadata key {key} is {_shown(value)}, expected an integer") from None
    # Counts size loops and tables: bound them before anyone builds range(count) (packer.limits).
    limit = ARCH_COUNT_LIMITS.get(key.partition(".")[2])
    if limit is not None and not 0 <= value <= limit:
        raise _refuse(
            f"metadata key {key} is {value}, not a count from 0 to at most {limit} (see {LIMITS_DOC})",
            "the file is damaged: re-download or re-convert it",
        )
    return int(value)


def _shown(value: object, limit: int = 80) -> str:
    """repr() of a metadata value for a message, cut short: a bad file's can be huge."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _stacked_roles(tensors: Iterable[TensorLike]) -> dict[int, dict[str, TensorLike]]:
    """Group the expert tensors by block: {block: {role name: tensor}}; refuse unknown names."""
    layers: dict[int, dict[str, TensorLike]] = {}
    for t in tensors:
        if "exps" not in t.name:
            continue
        m = _EXPERT_TENSOR.match(t.name)
        if not m:
            raise _refuse(f"tensor {t.name} looks like a routed-expert tensor but has an unknown name")
        block, role, kind = int(m.group(1)), m.group(2), m.group(3)
        name = role if kind == "weight" else f"{role}.bias"
        layers.setdefault(block, {})[name] = t
    return layers


def _role_sort_key(name: str) -> tuple[int, int]:
    base, _, bias = name.partition(".")
    return (1 if bias else 0, _ROLE_ORDER.index(base))


def _generic_plan(source: SourceLike, arch: str) -> ExpertPlan:
    meta = source.metadata
    tensors = list(source.tensors.values())
    stacked = _stacked_roles(tensors)
    if not stacked:
        raise _refuse(
            f"architecture {arch!r} has no routed-expert tensors (blk.N.ffn_*_exps.weight)",
            "an Expert Pack is only useful for mixture-of-experts models",
        )
    n_expert = _meta_int(meta, f"{arch}.expert_count")
    top_k = _meta_int(meta, f"{arch}.expert_used_count")
    if n_expert <= 0:
        raise _refuse(f"{arch}.expert_count is {n_expert}")
    if not 0 < top_k <= n_expert:
        raise _refuse(f"{arch}.expert_used_count is {top_k}, expected 1..{n_expert}")

    # A block with a router but no experts cannot run from a pack.
    for t in tensors:
        m = _BLOCK.match(t.name)
        if m and t.name.endswith("ffn_gate_inp.weight") and int(m.group(1)) not in stacked:
            raise _refuse(f"blk.{m.group(1)} has a router ({t.name}) but no routed-expert tensors")

    first_block = min(stacked)
    names = sorted(stacked[first_block], key=_role_sort_key)
    weights = [n for n in names if "." not in n]
    if weights not in (["gate", "up", "down"], ["gate_up", "down"]):
        raise _refuse(
            f"blk.{first_block} has expert roles {names}; expected gate, up, down "
            "(or fused gate_up, down)"
        )
    layers = []
    for block in sorted(stacked):
        have = stacked[block]
        missing = [n for n in names if n not in have]
        extra = sorted(set(have) - set(names))
        if missing:
            t = _tensor_name(block, missing[0])
            raise _refuse(f"blk.{block} lacks {t} (other MoE layers have it)")
        if extra:
            raise _refuse(f"tensor {_tensor_name(block, extra[0])} has no counterpart in blk.{first_block}")
        roles = []
        for name in names:
            t = have[name]
            shape = tuple(int(d) for d in t.shape)
            want_dims = 2 if name.endswith(".bias") else 3
            if len(shape) != want_dims:
                raise _refuse(
                    f"tensor {t.name} has shape {shape}, expected {want_dims} dimensions with experts outermost")
            if shape[0] != n_expert:
                raise _refuse(
                    f"tensor {t.name} holds {shape[0]} experts but {arch}.expert_count is {n_expert}",
                    "the file is inconsistent; re-download or re-convert it",
                )
            if t.nbytes % n_expert:
                raise _refuse(f"tensor {t.name}: {t.nbytes} bytes do not split into {n_expert} equal experts")
            roles.append(RolePlan(name=name, tensor=t, nbytes=t.nbytes // n_expert, shape=shape[1:]))
        _check_ffn_shapes(block, {r.name: r for r in roles})
        layers.append(LayerPlan(block=block, roles=tuple(roles)))
    return ExpertPlan(architecture=arch, num_experts=n_expert, expert_used_count=top_k, layers=tuple(layers))


def _tensor_name(block: int, role: str) -> str:
    base, _, bias = role.partition(".")
    return f"blk.{block}.ffn_{base}_exps.{'bias' if bias else 'weight'}"


def _check_ffn_shapes(block: int, roles: Mapping[str, RolePlan]) -> None:
    """gate/up map hidden -> ff and down maps ff -> hidden; anything else is not an FFN we know."""
    down = roles["down"]
    if "gate" in roles:
        gate, up = roles["gate"], roles["up"]
        if gate.shape != up.shape:
            raise _refuse(f"{gate.tensor.name} {gate.shape} and {up.tensor.name} {up.shape} differ per expert")
        ff, hidden = gate.shape
    else:
        two_ff, hidden = roles["gate_up"].shape
        ff = two_ff // 2
    if down.shape != (hidden, ff):
        raise _refuse(
            f"{down.tensor.name} has per-expert shape {down.shape}, expected {(hidden, ff)} from the gate/up tensors"
        )


def _require_moe_blocks(plan: ExpertPlan, expected: range, why: str) -> None:
    """Refuse the first block of `expected` without routed experts.

    Walks the range lazily (never ``set(range(block_count))``): every step either
    finds one of the plan's layers or stops, so it takes at most len(plan.layers) + 1
    steps whatever the metadata claims.
    """
    have = {layer.block for layer in plan.layers}
    for block in expected:
        if block not in have:
            raise _refuse(f"blk.{block} should be an MoE layer ({why}) but has no ffn_*_exps tensors")


def _leading_dense(plan: ExpertPlan, meta: Mapping[str, Any], arch: str, default: int) -> int:
    lead = _meta_int(meta, f"{arch}.leading_dense_block_count", required=False)
    lead = default if lead is None else lead
    for layer in plan.layers:
        if layer.block < lead:
            raise _refuse(
                f"tensor {layer.roles[0].tensor.name} gives routed experts to blk.{layer.block}, "
                f"but {arch}.leading_dense_block_count = {lead} says it is dense"
            )
    return lead


def _deepseek4(source: SourceLike) -> ExpertPlan:
    arch = "deepseek4"
    plan = _generic_plan(source, arch)
    if plan.role_names != ("gate", "up", "down"):
        raise _refuse(f"deepseek4 experts must be gate, up, down; found {list(plan.role_names)}")
    meta = source.metadata
    blocks = _meta_int(meta, f"{arch}.block_count", required=False)
    nextn = _meta_int(meta, f"{arch}.nextn_predict_layers", required=False) or 0
    if blocks is not None:
        # Every main layer of DeepSeek-V4 is MoE (the hash layers too); MTP layers may be.
        _require_moe_blocks(plan, range(blocks - nextn), "every DeepSeek-V4 layer routes experts")
    return plan


def _kimi_k3(source: SourceLike) -> ExpertPlan:
    arch = "kimi-k3"
    plan = _generic_plan(source, arch)
    if plan.role_names != ("gate", "up", "down"):
        raise _refuse(f"kimi-k3 experts must be gate, up, down; found {list(plan.role_names)}")
    meta = source.metadata
    lead = _leading_dense(plan, meta, arch, default=1)
    latent = _meta_int(meta, f"{arch}.expert_latent_length")
    for layer in plan.layers:
        gate = layer.roles[0]
        if gate.shape[-1] != latent:
            raise _refuse(
                f"tensor {gate.tensor.name} takes inputs of width {gate.shape[-1]}, but Kimi-K3 experts run "
                f"at the latent width {arch}.expert_latent_length = {latent}"
            )
    blocks = _meta_int(meta, f"{arch}.block_count", required=False)
    if blocks is not None:
        _require_moe_blocks(plan, range(lead, blocks), f"layers from {lead} on route experts")
    return plan


def _deepseek2(source: SourceLike) -> ExpertPlan:
    arch = "deepseek2"
    plan = _generic_plan(source, arch)
    meta = source.metadata
    lead = _leading_dense(plan, meta, arch, default=0)
    blocks = _meta_int(meta, f"{arch}.block_count", required=False)
    nextn = _meta_int(meta, f"{arch}.nextn_predict_layers", required=False) or 0
    if blocks is not None:
        _require_moe_blocks(plan, range(lead, blocks - nextn), f"layers from {lead} on route experts")
    return plan


ADAPTERS: dict[str, Callable[[SourceLike], ExpertPlan]] = {
    "deepseek4": _deepseek4,
    "kimi-k3": _kimi_k3,
    "deepseek2": _deepseek2,
}


def plan_experts(source: SourceLike) -> ExpertPlan:
    """The routed-expert plan of `source` (a GGUFSource): layers, roles, source tensors.

    Known architectures get their own checks; any other architecture with stacked
    `ffn_{gate,up,down}_exps` (or fused `ffn_gate_up_exps`) tensors uses the generic
    rule. Raises UnsupportedLayoutError naming the offending tensor or key.
    """
    arch = source.architecture or source.metadata.get("general.architecture")
    if not arch:
        raise _refuse("the GGUF has no general.architecture", "this is not a model file ExpertDesk can pack")
    adapter = ADAPTERS.get(arch)
    return adapter(source) if adapter else _generic_plan(source, arch)

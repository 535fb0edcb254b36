"""Stage *plan*: which modules of which block are calibrated and how their statistics are grouped.

Pure functions of the layer map, the merged tower and the config. `select_modules` runs before any
model is loaded (a config that selects nothing fails there); `plan_blocks` groups the selection once,
with the layer map specialised for the batches (`LayerMap.for_batches`), since grouping may depend on them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ..architectures import LINEAR, LayerMap, ModuleSpec
from ..config import FeatCalConfig, matches_module_pattern
from ..parameters import ModelParameters


@dataclass(frozen=True)
class BlockSelection:
    """The selected modules of one block."""

    stack_index: int
    block_index: int
    specs: list[ModuleSpec]
    # set in the last block of a pooled-head stack: its non-key/value modules down-weight other tokens
    pooled_token_index: int | None


@dataclass
class BlockPlan:
    """The selected modules of one block and how their statistics are grouped."""

    stack_index: int
    block_index: int
    specs: list[ModuleSpec]
    pooled_token_index: int | None
    # (captured input, pooled-token weighting, weight source) → modules sharing those statistics
    linear_groups: dict[tuple[str, bool, str], list[str]] = field(default_factory=dict)
    norms: list[tuple[str, bool]] = field(default_factory=list)  # (module, pooled)

    @property
    def capture_sources(self) -> list[str]:
        sources = {key[0] for key in self.linear_groups} | {name for name, _ in self.norms}
        return sorted(sources)

    @property
    def calibrating(self) -> bool:
        return bool(self.specs)

    def spec(self, name: str) -> ModuleSpec:
        return next(s for s in self.specs if s.name == name)


#: (stack index, block index) → the block's plan, in forward order
Plan = dict[tuple[int, int], BlockPlan]


def select_modules(layer_map: LayerMap, tower: nn.Module, config: FeatCalConfig) -> list[BlockSelection]:
    """Every block's selected modules (ValueError naming the config field when the selection is wrong)."""
    stacks = layer_map.stacks(tower)
    total_blocks = sum(len(s.blocks) for s in stacks)
    if config.layers_to_transform is not None:
        assert isinstance(config.layers_to_transform, list)  # FeatCalConfig makes a single index a list
        bad = [i for i in config.layers_to_transform if not -total_blocks <= i < total_blocks]
        if bad:
            raise ValueError(
                f"FeatCalConfig.layers_to_transform has block indices {bad} outside the model's "
                f"{total_blocks} blocks."
            )
    selection: list[BlockSelection] = []
    all_names: set[str] = set()
    flat = 0
    for si, stack in enumerate(stacks):
        for bi, block in enumerate(stack.blocks):
            specs = layer_map.block_modules(block)
            all_names.update(n for s in specs for n in (s.name, *s.aliases))
            chosen = [
                s
                for s in specs
                if config.block_selected(flat, total_blocks)
                and config.module_selected(s.name, *s.aliases)
                and (s.kind == LINEAR or config.calibrate_norms)
            ]
            pooled = stack.pooled_token_index if bi == len(stack.blocks) - 1 else None
            selection.append(BlockSelection(si, bi, chosen, pooled))
            flat += 1
    _check_patterns(config, all_names)
    if not any(s.specs for s in selection):
        raise ValueError(
            "FeatCalConfig selects no module to calibrate (check target_modules, exclude_modules, "
            f"layers_to_transform and calibrate_norms); block modules are: {sorted(all_names)}."
        )
    return selection


def plan_blocks(layer_map: LayerMap, selection: list[BlockSelection]) -> Plan:
    """Group each block's selected modules by the statistics they share."""
    return {(s.stack_index, s.block_index): _group(layer_map, s) for s in selection}


def _group(lm: LayerMap, selected: BlockSelection) -> BlockPlan:
    specs, pooled = selected.specs, selected.pooled_token_index
    plan = BlockPlan(selected.stack_index, selected.block_index, specs, pooled)
    by_name = {s.name: s for s in specs}
    for spec in specs:
        weighted = pooled is not None and spec.name not in lm.key_value_modules
        if spec.kind != LINEAR:
            plan.norms.append((spec.name, weighted))
            continue
        # modules reading one captured input share statistics: the same capture point, or a
        # shared-input group of the layer map (captured at its first selected member)
        group = next((g for g in lm.shared_input_groups if spec.name in g), (spec.name,))
        source = by_name[next(n for n in group if n in by_name)].capture
        key = (source, weighted, lm.weight_source(spec.name))
        plan.linear_groups.setdefault(key, []).append(spec.name)
    return plan


def _check_patterns(config: FeatCalConfig, names: set[str]) -> None:
    for argument in ("target_modules", "exclude_modules"):
        patterns = getattr(config, argument)
        if patterns is None:
            continue
        # a regex string is one pattern; a list is checked entry by entry
        entries = [patterns] if isinstance(patterns, str) else [[p] for p in patterns]
        for entry in entries:
            if not any(matches_module_pattern(entry, n) for n in names):
                shown = entry if isinstance(entry, str) else entry[0]
                raise ValueError(
                    f"FeatCalConfig.{argument} entry {shown!r} matches no module; block modules are: "
                    f"{sorted(names)}."
                )


def block_parameter_names(plan: BlockPlan, block: nn.Module, parameters: ModelParameters) -> list[str]:
    """Qualified names of the parameters FeatCal may write in one block."""
    names: dict[str, None] = {}  # ordered set: packed specs share their parameters
    for spec in plan.specs:
        module = block.get_submodule(spec.owner)
        names.update((parameters.qualified_name(module, attr), None) for attr in spec.attributes(block))
    return list(names)

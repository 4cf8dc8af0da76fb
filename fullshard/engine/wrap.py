"""Wrap policies: which modules become units, and which unit owns each parameter.

A policy is one of
- None (the default): the units a user would pick (`default_unit_modules`): the modules whose
  class is named in the model's `_no_split_modules` (Hugging Face's convention, what
  Accelerate's FSDP auto-wrap uses), else the repeated blocks: the children of every
  `nn.ModuleList` / `nn.Sequential` holding >= 2 modules of one class that have parameters
  (e.g. `transformer.h.0..N`), outermost such containers only; else the root alone;
- "root" (`ROOT_ONLY`) or an empty collection: the root is the only unit;
- a set (or list/tuple) of module classes: every instance becomes a unit; one class alone
  (`auto_wrap_policy=Block`) means `{Block}`;
- torch's `ModuleWrapPolicy` (its module classes are used);
- a callable `policy(module, recurse, nonwrapped_numel) -> bool` with torch FSDP1's meaning:
  called with `recurse=True` to ask whether to look inside `module`, and with `recurse=False`
  (bottom-up, `nonwrapped_numel` = parameters in its subtree not yet claimed by a unit below)
  to ask whether `module` becomes a unit. `size_based_auto_wrap_policy` works as is.

Modules marked by torch's `wrap()` inside `enable_wrap` (`FSDPStrategy.module_sharded_context`,
see `mark_unit`) are units too, whatever the policy. Ignored modules (`ignored.py`) are never
units and their parameters count for no `nonwrapped_numel`.

The root is always a unit. A parameter belongs to the innermost unit that contains every
module holding it: for a weight tied between two units, their innermost common ancestor.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import nn

from fullshard.engine.ignored import Ignored

WrapPolicy = Callable[[nn.Module, bool, int], bool]

ROOT_ONLY = "root"
"""`auto_wrap_policy="root"`: the whole model is one unit (the default picks blocks)."""


def normalize_policy(policy: object, name: str = "auto_wrap_policy") -> WrapPolicy | None:
    """Turn any explicit policy spelling into a callable (None: root only); `name` is the
    argument the errors name (`activation_checkpointing_policy` takes the same forms).

    `policy=None` (the default units) is resolved per model by `choose_units`; here it is
    only validated, like every other spelling.
    """
    if policy is None or (isinstance(policy, str) and policy == ROOT_ONLY):
        return None
    if isinstance(policy, type):  # a class is callable, but never a (module, recurse, n) policy
        policy = {policy}
    classes = getattr(policy, "_module_classes", None)  # torch's ModuleWrapPolicy
    if classes is not None:
        policy = set(classes)
    if isinstance(policy, set | frozenset | list | tuple):
        classes = tuple(policy)
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad:
            raise TypeError(
                f"{name}: a wrap policy given as classes must hold nn.Module subclasses; got "
                f"{bad!r}"
            )

        def by_class(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
            return recurse or isinstance(module, classes)

        return by_class
    if callable(policy) and not isinstance(policy, nn.Module):
        return policy  # type: ignore[return-value]
    raise TypeError(
        f"{name} must be None, a set of nn.Module classes, a ModuleWrapPolicy, a "
        f"callable (module, recurse, nonwrapped_numel) -> bool, or {ROOT_ONLY!r} (the root "
        f"as the only unit); got {type(policy).__name__} {policy!r}"
    )


_MANUAL_UNIT = "_fullshard_manual_unit"


def mark_unit(module: nn.Module) -> nn.Module:
    """Make `module` a unit when its model is sharded (torch's `wrap()` under
    `module_sharded_context`). A plain instance attribute, so it survives `deepcopy`."""
    object.__setattr__(module, _MANUAL_UNIT, True)
    return module


@dataclass(frozen=True)
class UnitChoice:
    """The units of a model and why they were chosen (for reprs and `fullshard plan`)."""

    modules: tuple[nn.Module, ...]
    """Root first, then in `named_modules()` order."""
    reason: str
    """E.g. 'default: _no_split_modules', 'default: repeated blocks', 'auto_wrap_policy'."""

    def describe(self) -> str:
        """E.g. 'root + 4 x Block (default: repeated blocks)'."""
        units = describe_unit_classes(type(m).__name__ for m in self.modules[1:])
        return f"{units} ({self.reason})"


def describe_unit_classes(class_names: Iterable[str]) -> str:
    """'root + 2 x GPT2Block' for the non-root units' class names."""
    counts = Counter(class_names)  # in first-seen order
    return " + ".join(["root", *(f"{n} x {c}" for c, n in counts.items())])


def default_unit_modules(
    root: nn.Module, ignored: Ignored | None = None
) -> tuple[list[nn.Module], str]:
    """The default units besides the root, and the rule that picked them (module docstring).
    Ignored modules never become units."""
    skip = ignored.modules if ignored is not None else frozenset()
    wanted = set(getattr(root, "_no_split_modules", None) or ())
    found = [m for m in root.modules() if m is not root and type(m).__name__ in wanted]
    if found:
        return [m for m in found if id(m) not in skip], "default: _no_split_modules"
    blocks: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if _is_repeated_blocks(module):
            blocks.extend(module.children())  # not looking inside the blocks
        else:
            for child in module.children():
                visit(child)

    visit(root)
    if blocks:
        return [m for m in blocks if id(m) not in skip], "default: repeated blocks"
    return [], "default: root only, no repeated blocks found"


def _is_repeated_blocks(module: nn.Module) -> bool:
    if not isinstance(module, nn.ModuleList | nn.Sequential):
        return False
    children = list(module.children())
    return (
        len(children) >= 2
        and len({type(c) for c in children}) == 1
        and all(any(True for _ in c.parameters()) for c in children)
    )


def choose_units(
    root: nn.Module, policy: object, ignored: Ignored | None = None
) -> UnitChoice:
    """The units of `root` under `policy` (None: the default rule), root first. Modules marked
    by `mark_unit` (torch's `wrap()` under `module_sharded_context`) are units either way."""
    if policy is None:
        extra, reason = default_unit_modules(root, ignored)
    else:
        fn = normalize_policy(policy)
        extra = [] if fn is None else policy_modules(root, fn, ignored)
        reason = ""  # named below, once the units are known
    ids = {id(root), *map(id, extra), *map(id, _manual_units(root, ignored))}
    modules = tuple(m for m in root.modules() if id(m) in ids)
    if not reason:
        reason = "auto_wrap_policy" if len(modules) > 1 else "root only"
    return UnitChoice(modules, reason)


def _manual_units(root: nn.Module, ignored: Ignored | None) -> list[nn.Module]:
    skip = ignored.modules if ignored is not None else frozenset()
    return [m for m in root.modules() if m.__dict__.get(_MANUAL_UNIT) and id(m) not in skip]


def select_units(
    root: nn.Module, policy: object, ignored: Ignored | None = None
) -> list[nn.Module]:
    """The unit modules, root first, then in `named_modules()` order."""
    return list(choose_units(root, policy, ignored).modules)


def policy_modules(
    root: nn.Module, fn: WrapPolicy, ignored: Ignored | None = None,
    numel_of: dict[int, int] | None = None, *, claim: bool = True,
) -> list[nn.Module]:
    """The modules (never the root) torch's recursive rule picks under `fn`, in `modules()`
    order: ask with `recurse=True` and the subtree's parameter count whether to look inside,
    then bottom-up with `recurse=False` and the count not yet claimed below whether to pick
    the module. `numel_of`: unsharded sizes by parameter id (the registered ones may be shards
    by now); `claim`: a picked module's parameters count for no module visited after it."""
    skip = ignored.modules if ignored is not None else frozenset()
    seen: set[int] = set(ignored.params) if ignored is not None else set()
    numel_of = numel_of or {}
    chosen: set[int] = set()

    def visit(module: nn.Module, is_root: bool) -> int:
        """Returns the parameter count claimed by picked modules in this subtree."""
        numel = sum(numel_of.get(id(p), p.numel()) for p in module.parameters()
                    if id(p) not in seen)
        if not fn(module, True, numel):
            return 0
        wrapped = sum(visit(child, False) for child in module.children() if id(child) not in skip)
        if not is_root and fn(module, False, numel - wrapped):
            chosen.add(id(module))
            if claim:
                seen.update(id(p) for p in module.parameters())
            return numel
        return wrapped

    visit(root, True)
    return [m for m in root.modules() if id(m) in chosen]


@dataclass
class ParamOwnership:
    """Each parameter (by first name) with the modules that hold it and its owning unit."""

    name: str
    param: nn.Parameter | None
    """The parameter object found at wrap time (a meta tensor if the model was on meta);
    cleared once it is sharded so the full tensor can be freed."""
    refs: list[tuple[nn.Module, str]]
    unit: nn.Module

    @property
    def current(self) -> nn.Parameter:
        """The parameter the modules hold now (materialization replaces meta ones)."""
        module, attr = self.refs[0]
        return module._parameters[attr]  # type: ignore[return-value]


def assign_params(
    root: nn.Module, units: Iterable[nn.Module], ignored: Ignored | None = None
) -> list[ParamOwnership]:
    """Find every parameter, every `(module, attribute)` holding it, and its owning unit, in
    `named_parameters()` order.

    A module may sit at several places in the tree (one `nn.Linear` reused by two blocks):
    every place counts, so its parameters go to the innermost unit enclosing all of them.
    Ignored parameters belong to no unit and are left out.
    """
    skip = ignored.params if ignored is not None else frozenset()
    unit_ids = {id(u) for u in units}
    unit_parent: dict[int, nn.Module | None] = {id(root): None}
    enclosing: dict[int, list[nn.Module]] = {}  # module -> innermost unit at each place

    def walk(module: nn.Module, current: nn.Module) -> None:
        enclosing.setdefault(id(module), []).append(current)
        for child in module.children():
            if id(child) in unit_ids:
                unit_parent.setdefault(id(child), current)
                walk(child, child)
            else:
                walk(child, current)

    walk(root, root)

    def ancestors(u: nn.Module) -> list[nn.Module]:
        chain = [u]
        while (parent := unit_parent[id(chain[-1])]) is not None:
            chain.append(parent)
        return chain

    def common(a: nn.Module, b: nn.Module) -> nn.Module:
        other = set(map(id, ancestors(b)))
        return next(u for u in ancestors(a) if id(u) in other)

    found: dict[int, ParamOwnership] = {}
    for mod_name, module in root.named_modules():
        places = enclosing[id(module)]
        for attr, p in module._parameters.items():
            if p is None or id(p) in skip:
                continue
            entry = found.get(id(p))
            if entry is None:
                name = f"{mod_name}.{attr}" if mod_name else attr
                entry = found[id(p)] = ParamOwnership(name, p, [], places[0])
            entry.refs.append((module, attr))
            for unit in places:
                entry.unit = common(entry.unit, unit)
    return list(found.values())

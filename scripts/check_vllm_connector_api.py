"""Check ``KVPushConnector`` against a vLLM release's ``KVConnectorBase_V1``, from source alone.

Role: the tests prove kvpush against one vLLM release (the installed one); this script tells
whether another release's connector interface still fits, without installing or importing
that release. It reads both files with ``ast``, so the sources unpacked from a CUDA wheel
that cannot run here are enough::

    .venv/bin/python scripts/check_vllm_connector_api.py \\
        /tmp/vllm034/src/vllm/distributed/kv_transfer/kv_connector/v1/base.py

What it checks, for the base classes ``KVPushConnector`` names that the given ``base.py``
defines (``KVConnectorBase_V1``, ``SupportsHMA``):

- every method both define has the same binding (instance, class, static, property) and
  compatible parameters: the same names in the same positions, no parameter the base
  passes by keyword made positional-only, no default the base has dropped, ``*args`` and
  ``**kwargs`` kept where the base has them, nothing new that is required. A parameter only
  the base has is a problem when required and a note when optional (vLLM leaves it out
  where connectors predate it);
- every abstract method of the base is implemented;
- no method the connector overrides has left the base while the reference base (default:
  the installed vLLM's) still has it: vLLM would no longer call it;
- where ``base.py`` sits in a vLLM source tree, ``KVCacheLayout``'s members equal the
  layouts ``connector/page_layout.py`` addresses.

Base methods new since the reference are listed as information. Exit status: 0 compatible,
1 one ``problem:`` line per incompatibility, 2 an input that cannot be read.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONNECTOR = ROOT / "connector" / "push_connector.py"
PAGE_LAYOUT = ROOT / "connector" / "page_layout.py"
CONNECTOR_CLASS = "KVPushConnector"
BASE_REL = Path("distributed/kv_transfer/kv_connector/v1/base.py")

POSONLY, POS_OR_KW, KWONLY, VARARGS, VARKW = (
    "positional-only", "positional-or-keyword", "keyword-only", "*args", "**kwargs")


class InputError(Exception):
    """A file that cannot be read as what it should be (exit status 2)."""


@dataclass(frozen=True)
class Param:
    """One parameter of a method (``self`` / ``cls`` left out)."""

    name: str
    kind: str
    has_default: bool


@dataclass(frozen=True)
class Method:
    """A method as the class body defines it."""

    name: str
    owner: str
    binding: str  # instance, classmethod, staticmethod or property
    params: tuple[Param, ...]
    abstract: bool
    line: int

    def signature(self) -> str:
        """The parameter list, for messages."""
        parts = []
        for p in self.params:
            name = {VARARGS: f"*{p.name}", VARKW: f"**{p.name}"}.get(p.kind, p.name)
            parts.append(name + ("=..." if p.has_default else ""))
        prefix = "" if self.binding == "instance" else f"@{self.binding} "
        return f"{prefix}{self.name}({', '.join(parts)})"


def _decorator_names(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names = set()
    for dec in node.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if isinstance(target, ast.Name):
            names.add(target.id)
        elif isinstance(target, ast.Attribute):
            # abc.abstractmethod, functools.cached_property; x.setter marks a setter.
            names.add(target.attr)
    return names


def _params(args: ast.arguments, binding: str) -> tuple[Param, ...]:
    positional = [*args.posonlyargs, *args.args]
    # Defaults align with the last positional parameters.
    first_default = len(positional) - len(args.defaults)
    params = [Param(a.arg, POSONLY if i < len(args.posonlyargs) else POS_OR_KW,
                    i >= first_default) for i, a in enumerate(positional)]
    if binding != "staticmethod" and params:
        params = params[1:]  # self / cls: bound by Python, never passed by vLLM
    if args.vararg is not None:
        params.append(Param(args.vararg.arg, VARARGS, True))
    params.extend(Param(a.arg, KWONLY, d is not None)
                  for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True))
    if args.kwarg is not None:
        params.append(Param(args.kwarg.arg, VARKW, True))
    return tuple(params)


def _parse(path: Path) -> ast.Module:
    try:
        return ast.parse(path.read_text(), filename=str(path))
    except (OSError, SyntaxError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot parse {path}: {exc}") from exc


def _classes(module: ast.Module) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in module.body if isinstance(n, ast.ClassDef)}


def class_methods(cls: ast.ClassDef) -> dict[str, Method]:
    """The methods a class body defines, by name (the first definition of a name wins:
    a property's setter or an ``@overload`` repeats it)."""
    methods: dict[str, Method] = {}
    for node in cls.body:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        decorators = _decorator_names(node)
        if node.name in methods or "setter" in decorators or "overload" in decorators:
            continue
        binding = next((b for b in ("classmethod", "staticmethod", "property")
                        if b in decorators), "instance")
        if "cached_property" in decorators:
            binding = "property"
        methods[node.name] = Method(node.name, cls.name, binding,
                                    _params(node.args, binding),
                                    "abstractmethod" in decorators, node.lineno)
    return methods


def _base_names(cls: ast.ClassDef) -> list[str]:
    names = []
    for base in cls.bases:
        if isinstance(base, ast.Name):
            names.append(base.id)
        elif isinstance(base, ast.Attribute):
            names.append(base.attr)
    return names


def connector_class(path: Path, name: str) -> tuple[dict[str, Method], list[str]]:
    """The connector's own methods and the names of its base classes."""
    cls = _classes(_parse(path)).get(name)
    if cls is None:
        raise InputError(f"{path} defines no class {name}")
    return class_methods(cls), _base_names(cls)


def base_methods(path: Path, bases: list[str]) -> dict[str, Method]:
    """Methods of the connector's base classes that ``path`` defines, in the order Python
    resolves them (each class's own bases in the file after it), so a name's first
    definition is the one the connector inherits."""
    classes = _classes(_parse(path))
    if "KVConnectorBase_V1" not in classes:
        raise InputError(f"{path} defines no class KVConnectorBase_V1")
    order: list[str] = []
    pending = [b for b in bases if b in classes]
    while pending:
        name = pending.pop(0)
        if name in order:
            continue
        order.append(name)
        pending[:0] = [b for b in _base_names(classes[name]) if b in classes]
    merged: dict[str, Method] = {}
    for name in order:
        for method_name, method in class_methods(classes[name]).items():
            merged.setdefault(method_name, method)
    return merged


def compare(base: Method, ours: Method) -> tuple[list[str], list[str]]:
    """Problems and notes for one method both classes define."""
    problems: list[str] = []
    notes: list[str] = []
    where = f"{ours.name}"
    if base.binding != ours.binding:
        problems.append(f"{where}: {base.binding} in {base.owner}, {ours.binding} in "
                        f"{CONNECTOR_CLASS}")
        return problems, notes
    if base.binding == "property":
        return problems, notes

    def positional(m: Method) -> list[Param]:
        return [p for p in m.params if p.kind in (POSONLY, POS_OR_KW)]

    def has(m: Method, kind: str) -> bool:
        return any(p.kind == kind for p in m.params)

    b_pos, o_pos = positional(base), positional(ours)
    ours_by_name = {p.name: p for p in ours.params if p.kind in (POS_OR_KW, KWONLY)}
    for i, b in enumerate(b_pos):
        if i < len(o_pos):
            o = o_pos[i]
            if o.name != b.name:
                problems.append(f"{where}: parameter {i + 1} is `{b.name}` in {base.owner}, "
                                f"`{o.name}` in {CONNECTOR_CLASS} (vLLM may pass it by name)")
                continue
            if b.kind == POS_OR_KW and o.kind == POSONLY:
                problems.append(f"{where}: `{b.name}` is positional-only in "
                                f"{CONNECTOR_CLASS}; {base.owner} lets vLLM pass it by name")
            if b.has_default and not o.has_default:
                problems.append(f"{where}: `{b.name}` has a default in {base.owner} (vLLM "
                                f"may leave it out), none in {CONNECTOR_CLASS}")
            continue
        # Past the connector's positional parameters: *args takes it positionally, and by
        # name **kwargs or a keyword-only parameter of the same name does.
        by_name = b.kind == POSONLY or has(ours, VARKW) or b.name in ours_by_name
        if has(ours, VARARGS) and by_name:
            continue
        if b.has_default:
            notes.append(f"{where}: optional parameter `{b.name}` of {base.owner} is not "
                         f"accepted by {CONNECTOR_CLASS} (fine while vLLM leaves it out)")
        else:
            problems.append(f"{where}: required parameter `{b.name}` of {base.owner} is "
                            f"missing in {CONNECTOR_CLASS}")
    for o in o_pos[len(b_pos):]:
        if not o.has_default and not has(base, VARARGS):
            problems.append(f"{where}: {CONNECTOR_CLASS} requires `{o.name}`, which "
                            f"{base.owner} does not pass")

    b_names = {p.name for p in base.params if p.kind in (POS_OR_KW, KWONLY)}
    for b in (p for p in base.params if p.kind == KWONLY):
        o = ours_by_name.get(b.name)
        if o is not None:
            if b.has_default and not o.has_default:
                problems.append(f"{where}: `{b.name}` has a default in {base.owner} (vLLM "
                                f"may leave it out), none in {CONNECTOR_CLASS}")
        elif has(ours, VARKW):
            continue
        elif b.has_default:
            notes.append(f"{where}: optional keyword `{b.name}` of {base.owner} is not "
                         f"accepted by {CONNECTOR_CLASS} (fine while vLLM leaves it out)")
        else:
            problems.append(f"{where}: required keyword `{b.name}` of {base.owner} is "
                            f"missing in {CONNECTOR_CLASS}")
    for o in (p for p in ours.params if p.kind == KWONLY):
        if o.name not in b_names and not o.has_default:
            problems.append(f"{where}: {CONNECTOR_CLASS} requires keyword `{o.name}`, which "
                            f"{base.owner} does not pass")
    for kind, what in ((VARARGS, "extra positional arguments"),
                       (VARKW, "extra keyword arguments")):
        if has(base, kind) and not has(ours, kind):
            problems.append(f"{where}: {base.owner} takes {what} ({kind}), "
                            f"{CONNECTOR_CLASS} does not")
    return problems, notes


def enum_members(path: Path, name: str) -> dict[str, object]:
    """``NAME = literal`` members of an enum class, by name."""
    cls = _classes(_parse(path)).get(name)
    if cls is None:
        raise InputError(f"{path} defines no class {name}")
    members: dict[str, object] = {}
    for node in cls.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)):
            try:
                members[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return members


def module_literal(path: Path, name: str) -> object:
    """The literal value of a module-level assignment ``name = ...`` (annotated or not)."""
    for node in _parse(path).body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        # ``__version__ = version = "0.32.0"`` chains targets.
        value = getattr(node, "value", None)
        if value is not None and any(isinstance(t, ast.Name) and t.id == name
                                     for t in targets):
            return ast.literal_eval(value)
    raise InputError(f"{path} assigns no {name}")


def check_layouts(layout_file: Path, page_layout: Path) -> list[str]:
    """Problems: layouts the release has that page_layout does not address as it does."""
    release = enum_members(layout_file, "KVCacheLayout")
    ours = module_literal(page_layout, "LAYOUTS")
    assert isinstance(ours, dict)
    problems = []
    for name, order in release.items():
        if name not in ours:
            problems.append(f"KVCacheLayout.{name} {order} is not addressed by "
                            f"{page_layout.name}")
        elif tuple(ours[name]) != tuple(order):  # type: ignore[arg-type]
            problems.append(f"KVCacheLayout.{name} is {order} in {layout_file}, "
                            f"{tuple(ours[name])} in {page_layout.name}")
    return problems


def vllm_root_of(base: Path) -> Path | None:
    """The ``vllm`` package folder holding ``base`` (None for a file outside one)."""
    parts = base.resolve().parts
    if len(parts) > len(BASE_REL.parts) and Path(*parts[-len(BASE_REL.parts):]) == BASE_REL:
        root = Path(*parts[:-len(BASE_REL.parts)])
        return root if root.name == "vllm" else None
    return None


def version_of(vllm_root: Path | None) -> str:
    """The release a vLLM source tree is, from its ``_version.py`` ("?" if unknown)."""
    if vllm_root is None or not (vllm_root / "_version.py").is_file():
        return "?"
    try:
        return str(module_literal(vllm_root / "_version.py", "__version__"))
    except (InputError, ValueError):
        return "?"


def installed_base() -> Path | None:
    """``base.py`` of the vLLM this interpreter would import, found without importing it
    (a top-level ``find_spec`` executes nothing)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / BASE_REL
    return path if path.is_file() else None


def check(base: Path, reference: Path | None, connector: Path = CONNECTOR,
          page_layout: Path = PAGE_LAYOUT) -> tuple[list[str], list[str]]:
    """Problems and information lines for ``connector`` against ``base``."""
    ours, our_bases = connector_class(connector, CONNECTOR_CLASS)
    theirs = base_methods(base, our_bases)
    known = base_methods(reference, our_bases) if reference is not None else theirs
    problems: list[str] = []
    info: list[str] = []
    for name, method in ours.items():
        if name in theirs:
            p, n = compare(theirs[name], method)
            problems += p
            info += n
        elif name in known and not name.startswith("_"):
            problems.append(f"{name}: overridden by {CONNECTOR_CLASS} but no longer defined "
                            f"by {known[name].owner}, so vLLM no longer calls it")
    for name, method in theirs.items():
        if method.abstract and name not in ours:
            problems.append(f"{name}: abstract in {method.owner} ({base.name} line "
                            f"{method.line}), not implemented by {CONNECTOR_CLASS}")
    for name, method in theirs.items():
        if name not in known:
            kind = "abstract" if method.abstract else "default implementation inherited"
            if name in ours:
                kind = f"overridden by {CONNECTOR_CLASS}"
            info.append(f"new in {method.owner}: {method.signature()} ({kind})")
    root = vllm_root_of(base)
    if root is not None and (root / "v1" / "kv_cache_layout.py").is_file():
        layout_file = root / "v1" / "kv_cache_layout.py"
        layout_problems = check_layouts(layout_file, page_layout)
        problems += layout_problems
        if not layout_problems:
            info.append(f"KVCacheLayout members in {layout_file} are the layouts "
                        f"{page_layout.name} addresses")
    return problems, info


def main(argv: list[str] | None = None) -> int:
    """Command line: print the findings, return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", nargs="?", type=Path,
                        help="a vLLM source tree's kv_connector/v1/base.py, or its vllm/ "
                             "folder (default: the installed vLLM's)")
    parser.add_argument("--reference", type=Path,
                        help="the base.py the tests prove against, for what is new "
                             "(default: the installed vLLM's)")
    parser.add_argument("--connector", type=Path, default=CONNECTOR)
    args = parser.parse_args(argv)
    installed = installed_base()
    base = args.base or installed
    if base is not None and base.is_dir():
        base = base / BASE_REL
    reference = args.reference or installed
    if base is None:
        print("error: no vLLM is installed; give the path of a base.py", file=sys.stderr)
        return 2
    try:
        problems, info = check(base, reference, args.connector)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ref_root = vllm_root_of(reference) if reference is not None else None
    print(f"checked {CONNECTOR_CLASS} ({args.connector}) against {base} "
          f"(vLLM {version_of(vllm_root_of(base))}; reference vLLM {version_of(ref_root)})")
    for line in info:
        print(f"info: {line}")
    for line in problems:
        print(f"problem: {line}")
    print("compatible" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

"""Every request kind is one declared unit (:class:`llmrl.engine.requests.base.Kind`, named in
:data:`llmrl.engine.requests.KINDS`): checked here against the code, from the source.

For each kind: its payload is a dataclass; each Caller method it names exists and reaches the kind's ``send``
(read with ``ast`` from the Caller's source files, following calls to its own methods, to the methods of its
parts (``self.<part>.<method>``, a part being an attribute assigned with a class annotation: ``self._x: Part =
...``) and to functions of ``llmrl.engine.client``); its ``handle`` calls exactly the backend method it names,
handing it the payload as it came, an abstract method of :class:`~llmrl.engine.model.backend.ModelBackend` whose one
parameter ``request`` is annotated with the kind's payload type, and that
:class:`~llmrl.engine.model.hf_backend.HFBackend` implements with the same parameters. Every request method of the
backend serves a kind. And no Caller method sends a kind that is not declared, or one whose declaration does not
name it.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import textwrap
from functools import cache

import pytest

from llmrl.engine.client.caller import Caller
from llmrl.engine.model.backend import ModelBackend
from llmrl.engine.model.hf_backend import HFBackend
from llmrl.engine.requests import KINDS

CLIENT = "llmrl.engine.client"
REQUESTS = "llmrl.engine.requests"


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


@cache
def _module(name: str) -> tuple[ast.Module, dict[str, str]]:
    """A module's syntax tree and what its imported names stand for: a module (``"pkg.mod"``) or a function of
    one (``"pkg.mod:func"``)."""
    tree = ast.parse(inspect.getsource(importlib.import_module(name)))
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                names[alias.asname or alias.name] = full if _is_module(full) else f"{node.module}:{alias.name}"
    return tree, names


def _function(module: str, qualname: str) -> ast.AST | None:
    """The definition of ``qualname`` (``f`` or ``Class.method``) in ``module``."""
    node: ast.AST = _module(module)[0]
    for part in qualname.split("."):
        node = next((child for child in ast.iter_child_nodes(node)
                     if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and child.name == part), None)
        if node is None:
            return None
    return node


def _caller_method(name: str) -> tuple[str, str] | None:
    """Where the Caller's method ``name`` is defined: (module, qualname)."""
    for cls in Caller.__mro__:
        if name in vars(cls) and callable(vars(cls)[name]) and cls.__module__.startswith(CLIENT):
            return cls.__module__, f"{cls.__qualname__}.{name}"
    return None


def _own_method(module: str, qualname: str, name: str) -> tuple[str, str] | None:
    """Method ``name`` of the class that function ``qualname`` of ``module`` belongs to (what ``self.name`` is)."""
    owner = qualname.rpartition(".")[0]
    if owner and _is_function(module, f"{owner}.{name}"):
        return module, f"{owner}.{name}"
    return _caller_method(name)


def _part_method(module: str, qualname: str, part: str, name: str) -> tuple[str, str] | None:
    """What ``self.<part>.<name>`` is in function ``qualname``: method ``name`` of the class ``self.<part>`` is
    annotated with in the owner's class body (``self.<part>: Part = ...``), a class of ``llmrl.engine.client``."""
    owner = qualname.rpartition(".")[0]
    node, names = _function(module, owner) if owner else None, _module(module)[1]
    for sub in ast.walk(node) if node is not None else ():
        if (isinstance(sub, ast.AnnAssign) and isinstance(sub.target, ast.Attribute) and sub.target.attr == part
                and isinstance(sub.target.value, ast.Name) and sub.target.value.id == "self"
                and isinstance(sub.annotation, ast.Name) and ":" in names.get(sub.annotation.id, "")):
            mod, _, cls = names[sub.annotation.id].partition(":")
            if mod.startswith(CLIENT + ".") and _is_function(mod, f"{cls}.{name}"):
                return mod, f"{cls}.{name}"
    return None


def _is_public(name: str) -> bool:
    return not name.startswith("_") or (name.startswith("__") and name.endswith("__"))


def _edges(module: str, qualname: str) -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    """What a function refers to (called, or passed on as a callback): the request-module ``send*`` functions,
    and the functions of the Caller (its methods, by name via ``self``) and of ``llmrl.engine.client`` modules."""
    node = _function(module, qualname)
    _, names = _module(module)
    sends, calls = set(), set()

    def target(ref: str) -> None:
        mod, _, func = ref.partition(":")
        if mod.startswith(REQUESTS + ".") and func.startswith("send"):
            sends.add((mod, func))
        elif mod.startswith(CLIENT + ".") and func:
            calls.add((mod, func))

    for sub in ast.walk(node):
        if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Attribute)
                and isinstance(sub.value.value, ast.Name) and sub.value.value.id == "self"):
            where = _part_method(module, qualname, sub.value.attr, sub.attr)
            if where is not None:
                calls.add(where)
        elif isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name):
            base = sub.value.id
            if base == "self":
                where = _own_method(module, qualname, sub.attr)
                if where is not None:
                    calls.add(where)
            elif base in names and ":" not in names[base]:
                target(f"{names[base]}:{sub.attr}")
        elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load):
            if sub.id in names and ":" in names[sub.id]:
                target(names[sub.id])
            elif _is_function(module, sub.id):
                target(f"{module}:{sub.id}")
    return sends, {c for c in calls if _is_function(*c)}


def _is_function(module: str, qualname: str) -> bool:
    return isinstance(_function(module, qualname), (ast.FunctionDef, ast.AsyncFunctionDef))


def _reached(name: str, through_public: bool) -> set[tuple[str, str]]:
    """The ``send*`` functions Caller method ``name`` reaches; unless ``through_public``, not through another
    public Caller method (that one sends them itself), nor through a part's method of the same name as one (the
    part's half of that Caller method), but from that Caller method itself (its delegation)."""
    start = _caller_method(name)
    seen, todo, sends = {start}, [start], set()
    while todo:
        current = todo.pop()
        sent, calls = _edges(*current)
        sends |= sent
        for call in calls:
            method = call[1].rpartition(".")[2]
            entry = _caller_method(method)
            crosses = (call[0].startswith(CLIENT) and _is_public(method) and entry is not None
                       and current != entry)
            if call not in seen and (through_public or not crosses):
                seen.add(call)
                todo.append(call)
    return sends


def _send_of(kind) -> tuple[str, str]:
    return kind.send.__module__, kind.send.__name__


def _public_caller_methods() -> list[str]:
    names = {name for cls in Caller.__mro__ if cls.__module__.startswith(CLIENT) for name in vars(cls)}
    return sorted(name for name in names if _is_public(name) and _caller_method(name) is not None)


@pytest.mark.parametrize("name", sorted(KINDS))
def test_a_kind_is_named_by_its_name_and_its_payload_is_a_dataclass(name):
    kind = KINDS[name]
    assert kind.name == name
    assert dataclasses.is_dataclass(kind.payload) and isinstance(kind.payload, type)
    assert kind.send.__module__ == kind.handle.__module__, "a kind's two halves live in its one module"
    assert kind.send.__module__.startswith(REQUESTS + ".")


@pytest.mark.parametrize("name", sorted(KINDS))
def test_each_caller_method_a_kind_names_exists_and_sends_it(name):
    kind = KINDS[name]
    assert kind.caller_methods, f"kind {name!r} names no Caller method that sends it"
    for method in kind.caller_methods:
        assert callable(getattr(Caller, method, None)), f"kind {name!r} names Caller.{method}, which does not exist"
        assert _send_of(kind) in _reached(method, through_public=True), (
            f"Caller.{method} (named by kind {name!r}) never calls {kind.send.__module__}.{kind.send.__name__}")


START_UP = ("load", "prepare", "build")  # ModelBackend's abstract methods that serve no request kind


def _backend_calls(handle) -> list[ast.Call]:
    """The calls ``replica.backend.<method>(...)`` in a handler."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(handle)))
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "backend"]


@pytest.mark.parametrize("name", sorted(KINDS))
def test_a_kinds_handler_calls_the_backend_method_it_names_which_every_backend_has(name):
    kind = KINDS[name]
    called = {node.func.attr for node in _backend_calls(kind.handle)}
    assert called == ({kind.backend_method} if kind.backend_method else set()), (
        f"kind {name!r} declares backend method {kind.backend_method!r}; its handler calls {sorted(called)}")
    if kind.backend_method is None:
        return
    method = kind.backend_method
    assert method in ModelBackend.__abstractmethods__, f"ModelBackend has no abstract method {method!r}"
    assert method in vars(HFBackend), f"HFBackend does not implement {method!r}"
    declared = list(inspect.signature(getattr(ModelBackend, method)).parameters)
    implemented = list(inspect.signature(getattr(HFBackend, method)).parameters)
    assert implemented == declared, f"HFBackend.{method}{implemented} differs from ModelBackend.{method}{declared}"


@pytest.mark.parametrize("name", sorted(name for name, kind in KINDS.items() if kind.backend_method))
def test_a_kinds_backend_method_takes_its_typed_payload_and_the_handler_hands_it_on(name):
    """One style for every kind: the backend method's one argument is ``request``, annotated with the kind's payload
    type (imported from the kind's module), and the handler passes its payload through unchanged."""
    kind = KINDS[name]
    parameters = dict(inspect.signature(getattr(ModelBackend, kind.backend_method)).parameters)
    parameters.pop("self")
    assert list(parameters) == ["request"], (
        f"ModelBackend.{kind.backend_method} takes {list(parameters)}, not one typed request (the kind's payload)")
    annotation = parameters["request"].annotation
    annotation = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", repr(annotation))
    imported = _module(ModelBackend.__module__)[1].get(annotation)
    assert imported == f"{kind.payload.__module__}:{kind.payload.__name__}", (
        f"ModelBackend.{kind.backend_method}'s request is annotated {annotation!r} ({imported}), not kind {name!r}'s "
        f"payload {kind.payload.__module__}.{kind.payload.__name__}")
    payload = list(inspect.signature(kind.handle).parameters)[1]
    for call in _backend_calls(kind.handle):
        passed = [ast.unparse(arg) for arg in call.args] + [ast.unparse(k) for k in call.keywords]
        assert passed == [payload], (
            f"kind {name!r}'s handler calls backend.{call.func.attr}({', '.join(passed)}): hand it {payload!r}, the "
            "payload as it came")


def test_every_request_method_of_the_backend_serves_a_kind():
    served = {kind.backend_method for kind in KINDS.values()}
    orphans = sorted(set(ModelBackend.__abstractmethods__) - served - set(START_UP))
    assert orphans == [], f"ModelBackend methods that no request kind calls: {orphans}"


@pytest.mark.parametrize("name", sorted(KINDS))
def test_every_kind_is_sent_by_a_caller_method_and_its_module_declares_it(name):
    kind = KINDS[name]
    module = importlib.import_module(kind.send.__module__)
    declared = [getattr(module, "KIND", None), *getattr(module, "KINDS", ())]
    assert kind in declared, f"kind {name!r} is not declared by {module.__name__} (KIND or KINDS)"
    assert any(_caller_method(method) for method in kind.caller_methods), f"no Caller method sends kind {name!r}"


def test_no_caller_method_sends_a_kind_that_is_not_declared_or_does_not_name_it():
    by_send = {_send_of(kind): kind for kind in KINDS.values()}
    wrong = []
    for method in _public_caller_methods():
        for send in _reached(method, through_public=False):
            kind = by_send.get(send)
            if kind is None:
                wrong.append(f"Caller.{method} calls {send[0]}.{send[1]}, the send of no kind in KINDS")
            elif method not in kind.caller_methods:
                wrong.append(f"Caller.{method} sends kind {kind.name!r}, whose caller_methods do not name it")
    assert wrong == [], "\n".join(wrong)


def test_the_reader_finds_sends_through_helpers_and_client_modules():
    # snapshot hands its kind's send to the private helper _adapters, which calls it
    assert ("llmrl.engine.requests.adapters.snapshot", "send") in _reached("snapshot", through_public=True)
    assert ("llmrl.engine.requests.save", "send") in _reached("save", through_public=True)  # via saving.save_run
    assert ("llmrl.engine.requests.admin", "send_stats") in _reached("update", through_public=True)
    assert ("llmrl.engine.requests.admin", "send_stats") not in _reached("update", through_public=False)

"""Plugin classes checked against their contracts where they are registered: the hook and its signature, a head's
declarations (level, what it reads, which layers), the constructor and the arguments it is given (``args_schema``,
with the config's strict integers: 2.0 is refused where an integer is declared), an updater's per-sample
declaration; and the forms users bring from Lamorel: plugin instances where a class is taken, head keys that
collide with the entries of ``score()``'s results.

Lamorel takes ``custom_updater=MyUpdater(...)`` and module-function instances; llmrl builds every plugin itself,
on every server rank, from its class and the keyword arguments of its constructor. These checks run on the client
(``Caller(...)``) and at config time (:func:`llmrl.plugins.registry.resolve`), before any model loads. Finding
plugins by name is :mod:`llmrl.plugins.registry`'s; this module never imports it.
"""

from __future__ import annotations

import inspect

import torch

from llmrl.engine.config.checks import head_key_problem, strict_validator
from llmrl.engine.config.types import PluginSpec
from llmrl.engine.errors import InvalidArgumentType, PluginError, did_you_mean
from llmrl.plugins.contracts import Head, Initializer, Updater

_HOOK = {"head": "forward", "initializer": "initialize", "updater": "update"}
_HEAD_INIT = "__init__(self, llm, **args)"
_PLACEHOLDER = {"head": "MyHead", "initializer": "MyInitializer", "updater": "MyUpdater"}
# Lamorel's Caller(...) keywords, each a {llm_name: ...} dict, and the Caller(...) argument that replaces it
_LAMOREL_KEYWORDS = {"custom_updater": "updater", "custom_module_functions": "head",
                     "custom_model_initializer": "initializer"}


def accepted_form(kind: str, cls_name: str, key: str = "value") -> str:
    """How ``Caller(...)`` takes a plugin of ``kind``, spelled with the user's class name."""
    if kind == "head":
        return f'heads={{"{key}": {cls_name}}} or heads={{"{key}": ({cls_name}, {{"hidden": 128}})}}'
    if kind == "initializer":
        return f'initializers=[{cls_name}] or initializers=[({cls_name}, {{"arg": 1}})]'
    return f'updater={cls_name} or updater=({cls_name}, {{"arg": 1}})'


def constructor_problem(kind: str, cls, name: str) -> str | None:
    """Why the constructor of plugin class ``cls`` cannot be called as the engine calls it, or None: a head is built
    as ``HeadClass(llm, **args)``, an initializer or updater as ``Class(**args)`` (``args`` from the config)."""
    try:
        signature = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return None
    params = list(signature.parameters.values())[1:]  # without self
    where = f"{kind} {name!r} ({cls.__qualname__}): its constructor is __init__{signature}"
    if kind == "head":
        first = params[0] if params else None
        if first is None or first.kind is first.VAR_KEYWORD or first.kind is first.KEYWORD_ONLY or (
                first.kind is not first.VAR_POSITIONAL and first.name != "llm"):
            return (f"{where}, but the head contract is {_HEAD_INIT}: the engine calls {cls.__name__}(llm, **args) "
                    "with the LLM's LLMInfo first (sizes, dtype, device), then the config's args; take llm as the "
                    "first parameter (Lamorel's model_type / pre_encoded_input become args, or attributes of llm)")
        params = params[1:]
    elif any(p.name == "llm" and p.default is p.empty and p.kind is not p.VAR_POSITIONAL for p in params):
        return (f"{where}, but the {kind} contract is __init__(self, **args): it is built from the config's keyword "
                f"args alone (only heads receive llm; {_llm_source(kind)} gives it)")
    positional_only = [p.name for p in params if p.kind is p.POSITIONAL_ONLY]
    if positional_only:
        return (f"{where}, but {', '.join(positional_only)} can only be passed by position; the {kind} contract is "
                f"{_HEAD_INIT if kind == 'head' else '__init__(self, **args)'}, with the config's args passed by "
                "keyword")
    return None


def _llm_source(kind: str) -> str:
    return "an initializer's initialize(model, llm)" if kind == "initializer" else "an updater's trainer.llm"


def contract_problem(kind: str, cls, name: str) -> str | None:
    """Why ``cls`` breaks the ``kind`` contract (its hook, its head attributes, its constructor), or None."""
    from llmrl.plugins.per_sample import declaration_problem

    return (check_contract(kind, cls, name) or constructor_problem(kind, cls, name)
            or (declaration_problem(cls, name) if kind == "updater" else None))


def _describe(value) -> str:
    if inspect.isroutine(value):
        return f"the function {getattr(value, '__name__', value)!r}"
    if type(value).__module__ == "builtins":
        return f"a {type(value).__name__}"
    return f"an instance of {type(value).__qualname__}"


def _class_name(value, kind: str) -> str:
    """The class to show in a hint: the user's own (of an instance, or the class itself), else a placeholder."""
    if inspect.isclass(value):
        return value.__name__
    if inspect.isroutine(value) or type(value).__module__ == "builtins":
        return _PLACEHOLDER[kind]
    return type(value).__name__


def _per_llm_form(kind: str, value: dict) -> str:
    """How Lamorel's per-LLM dict (``{llm_name: plugin}``, for heads ``{llm_name: {key: module}}``) is written for
    ``Caller(...)``, with the user's names."""
    llm, inner = next(iter(value.items()), ("main", None))
    key = "value"
    if kind == "head" and isinstance(inner, dict) and inner:
        key, inner = next(iter(inner.items()))
    return (f"{accepted_form(kind, _class_name(inner, kind), key)}, with llm={llm!r} (Caller(...) takes the plugins "
            "of one LLM; those of other LLMs go in the config: llms.<name>.heads / initializers / updater)")


def refuse_lamorel_call(args: tuple, kwargs: dict) -> None:
    """Raise :class:`InvalidArgumentType` (a TypeError) when ``Caller(*args, **kwargs)`` is Lamorel's call (a config
    given by position, ``custom_updater=`` / ``custom_module_functions=`` / ``custom_model_initializer=``), with
    llmrl's form of it; other arguments are left to ``Caller.__init__``."""
    problems = []
    if args:
        problems.append(f"Caller() takes no positional argument (got {len(args)}): it finds its run and config itself "
                        "(`llmrl run --config run.yaml script.py`), so Lamorel's Caller(config_args.lamorel_args, "
                        "...) becomes Caller(...)")
    for keyword, kind in _LAMOREL_KEYWORDS.items():
        if keyword in kwargs:
            value = kwargs[keyword]
            form = (_per_llm_form(kind, value) if isinstance(value, dict)
                    else accepted_form(kind, _class_name(value, kind)))
            problems.append(f"Caller({keyword}=...) is Lamorel's; llmrl takes the class, not an instance: {form}")
    if problems:
        raise InvalidArgumentType("; ".join(problems))


def args_problem(cls, args: dict, name: str) -> str | None:
    """Why ``args`` do not fit the plugin's ``args_schema`` and constructor, or None."""
    schema = getattr(cls, "args_schema", None)
    if schema:
        errors = sorted(strict_validator()(schema).iter_errors(args), key=lambda e: list(e.path))
        if errors:
            return "; ".join(f"{'.'.join(map(str, e.absolute_path)) or 'args'}: {e.message}{_integer_hint(e)}"
                             for e in errors)
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return None
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        accepted = [n for n in params if n not in ("self", "llm")]
        unknown = [k for k in args if k not in accepted]
        if unknown:
            return (f"unknown argument(s) {unknown} for {name!r}; it accepts {accepted}"
                    f"{did_you_mean(unknown[0], accepted, cutoff=0.5)}")
    names = list(params)[1:]  # without self
    if names and names[0] == "llm":  # a head's LLMInfo, given by the engine
        names = names[1:]
    missing = [n for n in names if params[n].default is params[n].empty and n not in args
               and params[n].kind in (params[n].POSITIONAL_OR_KEYWORD, params[n].KEYWORD_ONLY)]
    if missing:
        return (f"missing required argument(s) {missing} for {name!r}, whose constructor is "
                f"__init__{inspect.signature(cls.__init__)}: give them in its args")
    return None


def _integer_hint(error) -> str:
    """A hint for a whole number written as a float where an integer is declared (``epochs: 2.0``)."""
    wanted = error.validator_value if error.validator == "type" else None
    wanted = [wanted] if isinstance(wanted, str) else wanted or []
    if "integer" in wanted and isinstance(error.instance, float) and error.instance.is_integer():
        return f" (write {int(error.instance)}, without the decimal point)"
    return ""


def given_spec(kind: str, value, where: str, key: str = "value") -> PluginSpec:
    """The spec of a plugin a script gives (a class, a ``(class, args)`` pair, a name, ``{plugin, args}``), checked
    now: an instance or a function is refused with the accepted form; a class must keep its contract and take its
    args."""
    target, args = value, {}
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict):
        target, args = value
    if isinstance(target, dict) and target and not {"plugin", "args"} & set(target):
        per_llm = {key: target} if kind == "head" else target  # Lamorel's heads: {llm_name: {key: module}}
        raise PluginError(f"{where} got a dict without 'plugin' (Lamorel's per-LLM form?): pass "
                          f"{_per_llm_form(kind, per_llm)}")
    if not (inspect.isclass(target) or isinstance(target, (str, dict, PluginSpec))):
        article = "an" if kind[0] in "aeiou" else "a"
        raise PluginError(f"{where} got {_describe(target)}, but llmrl takes the plugin's class and builds it itself "
                          f"on every server rank (Lamorel-style instances and functions cannot be sent): pass "
                          f"{accepted_form(kind, _class_name(target, kind), key)}, the dict holding the constructor's "
                          f"keyword arguments ({article} {kind} is a class with {_HOOK[kind]}(...): see "
                          "llmrl.plugins.contracts)")
    try:
        spec = PluginSpec.coerce(value, kind)
    except TypeError as err:
        raise PluginError(f"{where}: {err}; pass {accepted_form(kind, _PLACEHOLDER[kind], key)}") from None
    if inspect.isclass(target):
        problem = contract_problem(kind, target, spec.plugin) or args_problem(target, spec.args, spec.plugin)
        if problem:
            raise PluginError(f"{where}: {problem}")
    return spec


def given_plugins(heads=None, initializers=None, updater=None) -> dict | None:
    """The plugins handed to ``Caller(heads=, initializers=, updater=)``, as specs, checked before anything starts;
    None when none is given."""
    if not (heads or initializers or updater):
        return None
    if heads is not None and not isinstance(heads, dict):
        raise PluginError(f"Caller(heads=...) takes a dict of head classes by key, got {_describe(heads)}: pass "
                          f"{accepted_form('head', _PLACEHOLDER['head'])}")
    if initializers is not None and not isinstance(initializers, (list, tuple)):
        form = (_per_llm_form("initializer", initializers) if isinstance(initializers, dict) and initializers
                else accepted_form("initializer", _class_name(initializers, "initializer")))
        raise PluginError(f"Caller(initializers=...) takes a list, got {_describe(initializers)}: pass {form}")
    for key in heads or {}:
        problem = head_key_problem(key)
        if problem:
            raise PluginError(f"Caller(heads=...): {problem}")
    return {
        "heads": {k: given_spec("head", v, f"Caller(heads={{{k!r}: ...}})", k) for k, v in (heads or {}).items()},
        "initializers": [given_spec("initializer", v, f"Caller(initializers=[...]) item {i}")
                         for i, v in enumerate(initializers or [])],
        "updater": given_spec("updater", updater, "Caller(updater=...)") if updater else None,
    }


_HOOKS = {
    "head": ("forward", ["outputs"]),
    "initializer": ("initialize", ["model", "llm"]),
    "updater": ("update", ["batch", "trainer"]),
}
_BASES = {"head": Head, "initializer": Initializer, "updater": Updater}


def check_contract(kind: str, cls, name: str) -> str | None:
    """Why ``cls`` breaks the ``kind`` contract, or None if it keeps it."""
    if not inspect.isclass(cls):
        return f"plugin {name!r} must be a class, got {type(cls).__name__}"
    if kind == "head" and not issubclass(cls, torch.nn.Module):
        return f"head {name!r} ({cls.__qualname__}) must subclass llmrl.plugins.Head (a torch.nn.Module)"
    if kind == "head":
        problem = check_head_attributes(cls, name)
        if problem:
            return problem
    hook, expected = _HOOKS[kind]
    method = getattr(cls, hook, None)
    if method is None or method is getattr(_BASES[kind], hook):
        return f"{kind} {name!r} ({cls.__qualname__}) does not implement {hook}({', '.join(expected)})"
    params = [p for p in inspect.signature(method).parameters.values() if p.name != "self"]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    has_var = any(p.kind == p.VAR_POSITIONAL for p in params)
    if len(required) > len(expected) or (len(positional) < len(expected) and not has_var):
        got = ", ".join(p.name for p in params)
        extra = [p.name for p in required[len(expected):]]
        hint = (f"; a head's other arguments come from a call's head_kwargs, which may leave them out: give "
                f"{', '.join(extra)} a default (e.g. {extra[0]}=None)" if kind == "head" and extra else "")
        return (f"{kind} {name!r} ({cls.__qualname__}): {hook}({got}) does not match the contract "
                f"{hook}({', '.join(expected)}){hint}")
    return None


HEAD_LEVELS = ("context", "candidate", "token")


def check_head_attributes(cls, name: str) -> str | None:
    """Why a head class's declarations (``level``, ``needs_*``, ``hidden_layers``) are invalid, or None."""
    where = f"head {name!r} ({cls.__qualname__})"
    level = getattr(cls, "level", None)
    if level not in HEAD_LEVELS:
        return f"{where}: level = {level!r}; the level attribute must be one of {', '.join(HEAD_LEVELS)}"
    for attr in ("needs_context_hidden", "needs_candidate_hidden", "needs_token_hidden", "needs_logits",
                 "needs_context_logits"):
        if not isinstance(getattr(cls, attr, False), bool):
            return f"{where}: {attr} = {getattr(cls, attr)!r}; it must be True or False"
    layers = getattr(cls, "hidden_layers", (-1,))
    if (not isinstance(layers, (tuple, list)) or not layers
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers)):
        return (f"{where}: hidden_layers = {layers!r}; it must be a non-empty tuple of ints (indices into Hugging "
                "Face's hidden_states, e.g. (-1,) for the last layer, (0,) for the embeddings)")
    return None


def check_head_layers(cls, name: str, num_hidden_states: int) -> str | None:
    """Why a head's ``hidden_layers`` do not fit a model whose ``hidden_states`` has ``num_hidden_states`` entries
    (the embeddings and one per layer), or None."""
    bad = [i for i in cls.hidden_layers if not -num_hidden_states <= i < num_hidden_states]
    if bad:
        return (f"head {name!r} ({cls.__qualname__}): hidden_layers {tuple(bad)} out of range; this model's "
                f"hidden_states has {num_hidden_states} entries (the embeddings and {num_hidden_states - 1} layers): "
                f"use indices from {-num_hidden_states} to {num_hidden_states - 1}")
    return None

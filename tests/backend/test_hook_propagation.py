"""SGLang's hook propagation through an index (`backend/hook_propagation.py`) leaves every
module binding as SGLang's own walk leaves it: on modules written for the purpose, run
by SGLang's real `HookRegistry`, and in processes that imported what a server imports
with every hook the installed plugins register."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sgl_pd.backend.hook_propagation import BindingIndex, indexed_propagation

hook_registry = pytest.importorskip("sglang.srt.plugins.hook_registry")
HookRegistry, HookType = hook_registry.HookRegistry, hook_registry.HookType

MODULES = {
    "pdt_a": """
        import functools

        def f():
            return "f"

        def g():
            return "g"

        class C:
            def m(self):
                return "m"

        VALUE = functools.partial(f)
    """,
    # bound before any hook is applied
    "pdt_b": """
        from pdt_a import C, VALUE, f, g

        alias = f
    """,
    # bound before too: rebound once by pdt_a's hooks, then again by pdt_b's
    "pdt_b2": """
        from pdt_a import VALUE, f
    """,
    # first imported while the registry resolves its target, after others were patched
    "pdt_c_late": """
        from pdt_a import f, g

        def k():
            return "k"
    """,
    # imported last, for its target: g, which pdt_c_late bound after the index was built
    "pdt_e": """
        from pdt_a import g
    """,
}


def _around(tag: str) -> Callable[..., str]:
    def hook(original: Callable[..., str], *args: Any, **kwargs: Any) -> str:
        return f"{tag}({original(*args, **kwargs)})"

    return hook


# Sorted as the registry applies them: pdt_a.f is patched before pdt_b.alias (the same
# function, so patched twice); pdt_c_late and pdt_e are imported for their targets.
TARGETS = {
    "pdt_a.C.m": _around("m1"),
    "pdt_a.VALUE": _around("v1"),
    "pdt_a.f": _around("f1"),
    "pdt_b.VALUE": _around("v2"),  # (not a function, wrapped once already)
    "pdt_b.alias": _around("alias1"),
    "pdt_c_late.k": _around("k1"),
    "pdt_e.g": _around("g1"),
}


@pytest.fixture
def clean_registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """SGLang's registry and propagation as they were, the `pdt_*` modules written to a
    fresh folder on the path and forgotten again after."""
    for name, source in MODULES.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(HookRegistry, "_hooks", type(HookRegistry._hooks)(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())
    monkeypatch.setattr(hook_registry, "_propagate_patch", hook_registry._propagate_patch)
    yield tmp_path
    for name in MODULES:
        sys.modules.pop(name, None)


def _apply_and_read(propagate: Callable[[object, object, object], int]) -> dict[str, str]:
    """Import pdt_a, pdt_b and pdt_b2, apply TARGETS through SGLang's registry with `propagate`,
    and answer what each module attribute answers when called."""
    for name in MODULES:
        sys.modules.pop(name, None)
    HookRegistry.reset()
    import pdt_b  # noqa: F401  (bound before the hooks, as `from X import f` binds)
    import pdt_b2  # noqa: F401

    hook_registry._propagate_patch = propagate
    for target, hook in TARGETS.items():
        HookRegistry.register(target, hook, HookType.AROUND)
    HookRegistry.apply_hooks()
    answers = {}
    for name in MODULES:
        for attr, value in vars(sys.modules[name]).items():
            if attr.startswith("__") or isinstance(value, types.ModuleType):
                continue
            if isinstance(value, type):
                answers[f"{name}.{attr}.m"] = value().m()
            elif callable(value):
                answers[f"{name}.{attr}"] = value()
    return answers


def test_every_binding_ends_as_sglangs_own_walk_leaves_it(clean_registry: Path) -> None:
    walked = _apply_and_read(hook_registry._propagate_patch)
    indexed = _apply_and_read(indexed_propagation(BindingIndex()))
    assert indexed == walked
    # what makes the comparison worth having: each case of the module docstring occurs
    assert walked["pdt_a.f"] == "alias1(f1(f))"  # an alias patched twice, at the first source
    assert walked["pdt_b2.f"] == "alias1(f1(f))"  # ... and where the first one rebound it
    assert walked["pdt_b.f"] == "f1(f)"  # (the second one's source is skipped: SGLang's rule)
    assert walked["pdt_c_late.g"] == "g1(g)"  # bound by a module imported after the index
    assert walked["pdt_a.g"] == walked["pdt_b.g"] == "g1(g)"
    assert walked["pdt_a.VALUE"] == "v2(v1(f))"  # not a function: walked for ...
    assert walked["pdt_b2.VALUE"] == "v2(v1(f))"  # ... and where it was rebound, recorded
    assert walked["pdt_b.C.m"] == "m1(m)"


def test_a_binding_that_changed_or_left_sys_modules_since_it_was_indexed_is_left_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def original() -> None: ...
    def wrapped() -> None: ...
    def other() -> None: ...

    changed, gone = types.ModuleType("pdt_changed"), types.ModuleType("pdt_gone")
    changed.bound = gone.bound = original  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pdt_changed", changed)
    monkeypatch.setitem(sys.modules, "pdt_gone", gone)
    index = BindingIndex()
    index.catch_up()
    changed.bound = other  # type: ignore[attr-defined]
    del sys.modules["pdt_gone"]
    assert indexed_propagation(index)(original, wrapped, object()) == 0
    assert changed.bound is other  # type: ignore[attr-defined]
    assert gone.bound is original  # type: ignore[attr-defined]


def test_the_index_never_asks_a_lazy_attribute_for_its_class(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`isinstance` would call `__class__`: a lazy proxy imports or warns there."""

    class Proxy:
        @property  # type: ignore[misc]
        def __class__(self) -> type:
            raise AssertionError("asked for __class__")

    module = types.ModuleType("pdt_lazy")
    module.lazy = Proxy()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pdt_lazy", module)
    index = BindingIndex()
    index.catch_up()
    assert index.bound_to(module.lazy) == []  # type: ignore[attr-defined]


def test_the_index_lives_for_one_apply_hooks_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Made when SGLang applies the hooks, dropped after: nothing of ~10^5 bindings is
    kept for the life of the server, and a later call sees the modules as they are."""
    from sgl_pd.backend import hook_propagation

    walk = hook_registry._propagate_patch
    monkeypatch.setattr(hook_registry, "_propagate_patch", walk)
    seen: list[object] = []
    original_apply = HookRegistry.__dict__["apply_hooks"].__func__
    monkeypatch.setattr(
        HookRegistry,
        "apply_hooks",
        classmethod(lambda cls: seen.append(hook_registry._propagate_patch) or original_apply(cls)),
    )
    hook_propagation.install()
    hook_propagation.install()  # (idempotent)
    monkeypatch.setattr(HookRegistry, "_hooks", type(HookRegistry._hooks)(list))
    HookRegistry.apply_hooks()
    HookRegistry.apply_hooks()
    assert len(seen) == 2 and seen[0] is not seen[1] and walk not in seen
    assert hook_registry._propagate_patch is walk


# Imports what a server's scheduler and HTTP process import, loads the installed plugins
# (sgl_pd's among them) with SGLang's walk or the index, and prints, per module, a digest
# of what each of its function and class attributes is: its name, and down its chain of
# wrappers each one's name and, for the registry's wrappers, the hooks it calls.
_SERVER_LIKE = """
import hashlib, json, sys, types
import sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler
from sglang.srt.plugins import hook_registry, load_plugins
import sgl_pd.backend.hook_propagation as hp
if sys.argv[1] == "walk":
    hp.install = lambda: None  # the plugin keeps SGLang's own walk
load_plugins()
indexed = hook_registry.HookRegistry.__dict__["apply_hooks"].__func__
assert getattr(indexed, "sgl_pd_indexed", False) == (sys.argv[1] == "index")
del indexed

def name(value):
    return str(getattr(value, "__module__", "?")) + "." + str(getattr(value, "__qualname__", "?"))

def described(value):
    parts = []
    while True:
        parts.append(name(value))
        if type(value) is not types.FunctionType:
            return "/".join(parts)
        inner = value.__dict__.get("__wrapped__")
        if value.__code__.co_filename == hook_registry.__file__:
            cells = [c.cell_contents for c in value.__closure__ or ()]
            parts.append("hook:" + ",".join(sorted(name(c) for c in cells if c is not inner)))
        if inner is None:
            return "/".join(parts)
        value = inner

digests, hooked = {}, []
for module_name, module in sorted(sys.modules.items()):
    if type(module) is not types.ModuleType:
        continue
    lines = []
    for attr, value in sorted(vars(module).items()):
        if type(value) is types.FunctionType or issubclass(type(value), type):
            lines.append(attr + "=" + described(value))
            if "hook:" in lines[-1]:
                hooked.append(module_name + "." + attr)
    digests[module_name] = hashlib.sha1("\\n".join(lines).encode()).hexdigest()
print(json.dumps({"digests": digests, "hooked": hooked}))
"""


def test_a_server_process_ends_with_the_same_bindings_either_way() -> None:
    def start(mode: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", _SERVER_LIKE, mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    runs = {mode: start(mode) for mode in ("walk", "index")}
    seen = {}
    for mode, process in runs.items():
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0, err[-3000:]
        seen[mode] = json.loads(out.strip().splitlines()[-1])
    walked, indexed = seen["walk"]["digests"], seen["index"]["digests"]
    assert walked.keys() == indexed.keys()
    # (the script itself, and the module whose `install` it turned off for the walk)
    itself = {"__main__", "__mp_main__", "sgl_pd.backend.hook_propagation"}
    differing = [m for m in walked if walked[m] != indexed[m] and m not in itself]
    assert differing == [], differing
    # hook wrappers are among them: module-level targets, rebound where imported
    hooked = seen["walk"]["hooked"]
    assert any(name.startswith("sglang.srt.disaggregation.") for name in hooked), hooked
    assert len(hooked) == len(seen["index"]["hooked"])

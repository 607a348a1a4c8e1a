"""Classes and functions from ``__main__`` (a script, a notebook cell) shipped
by value: their source, and what they need from ``__main__``, become one
module file that goes to the pods with the actor's other files.

    t.actor(Trainer)        # class Trainer defined in this notebook
    t.function(score)       # def score(...) defined in this notebook

:func:`shipped` builds that file. Every global name the object's code reads
(found in its bytecode: ``LOAD_GLOBAL`` and ``LOAD_NAME``, not attribute
names) that ``__main__`` defines goes with it:

- a module: imported on the pods by its name (``np`` for ``numpy``);
- a class or function of another module: imported from it (that module must
  be installed on the pods, or sent in ``files=``);
- a class or function of ``__main__``: its source, and what it needs in turn;
- any other value: pickled here, unpickled when the module is imported there
  (instances of ``__main__``'s classes included).

What cannot travel is refused here, naming the object and what uses it: a
lambda or a class or function defined inside a function (no source of its
own to send), a value that does not pickle (an open socket, a lock, a
generator), an object whose source is gone (typed at a plain ``python``
prompt). The file's name is its content's hash: an unchanged class is not
sent again, and a changed one is a new module on warm workers.

Pickled arguments and results that name ``__main__``'s classes are read on
each side as the other side's: ``__main__`` on the pods is this module, and
this module is ``__main__`` here (:func:`loads`).
"""

import ast
import base64
import builtins
import dis
import hashlib
import importlib
import inspect
import io
import linecache
import pickle
import pickletools
import sys
import textwrap
import types

__all__ = ["shipped", "loads", "PREFIX", "CannotShip"]

# The module name of every shipped file starts with this (the pods map
# pickled `__main__` names to it, and the client maps it back).
PREFIX = "_trainlet_main_"

_GLOBAL_OPS = {"LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_FROM_DICT_OR_GLOBALS"}


class CannotShip(TypeError):
    """The object, or something it needs from ``__main__``, cannot travel to the pods."""


def shipped(obj):
    """``(target, files)`` for a class or function: ``"module:Name"`` and ``{}``
    when it lives in an importable module, else the target of a module built
    from ``__main__`` and ``{filename: source bytes}``. Raises
    :class:`CannotShip` saying what cannot travel and why."""
    if not (inspect.isclass(obj) or inspect.isfunction(obj)):
        raise TypeError("an actor is a class or a function (or 'module:Name'), not a %s" % type(obj).__name__)
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", obj.__name__)
    if "<locals>" in qualname:
        raise CannotShip("%s is defined inside a function (%s): define it at the top level of the script or "
                         "notebook, where the pods can build it from its source" % (obj.__name__, qualname))
    if obj.__name__ == "<lambda>":
        raise CannotShip("a lambda cannot be an actor: define the function with def")
    if module != "__main__":
        if module is None or module.startswith(PREFIX):
            raise CannotShip("%s has no module the pods can import" % qualname)
        return "%s:%s" % (module, qualname), {}
    main = sys.modules["__main__"]
    builder = _Builder(vars(main))
    builder.define(qualname, obj, "the actor")
    source = builder.source(qualname)
    name = PREFIX + hashlib.sha256(source.encode()).hexdigest()[:16]
    return "%s:%s" % (name, qualname), {name + ".py": source.encode()}


def loads(data):
    """``pickle.loads`` with the pods' shipped modules read as this ``__main__``."""
    return _MainUnpickler(io.BytesIO(data)).load()


class _MainUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module.startswith(PREFIX) and module not in sys.modules:
            module = "__main__"
        return super().find_class(module, name)


class _Builder:
    """The module being written: its lines in dependency order."""

    def __init__(self, main_globals):
        self.g = main_globals
        self.seen = set()
        self.chunks = []  # source texts, in the order they run
        self.uses_values = False

    def source(self, what):
        head = ['"""%s, shipped from __main__ by trainlet-client (generated; do not edit)."""' % what]
        if self.uses_values:
            head.append(_VALUE_HELPER)
        return "\n\n".join(head + self.chunks) + "\n"

    def need(self, name, user):
        """Name ``name``, read by ``user``'s code: define it here if ``__main__`` has it."""
        if name in self.seen:
            return
        self.seen.add(name)
        if name not in self.g:
            return  # a builtin, or undefined: as it would be here
        value = self.g[name]
        if value is getattr(builtins, name, object()):
            return
        if isinstance(value, types.ModuleType):
            if value.__name__ == "__main__":
                raise CannotShip("%s uses %s, which is __main__ itself" % (user, name))
            self.chunks.append("import importlib as _i; %s = _i.import_module(%r); del _i" % (name, value.__name__))
        elif inspect.isclass(value) or inspect.isfunction(value):
            self.define(name, value, user)
        elif inspect.isbuiltin(value) and isinstance(getattr(value, "__self__", None), types.ModuleType):
            self.chunks.append("import importlib as _i; %s = _i.import_module(%r).%s; del _i"
                               % (name, value.__self__.__name__, value.__name__))
        elif hasattr(value, "__wrapped__") and getattr(inspect.unwrap(value), "__module__", None) == "__main__":
            # A decorated function of __main__ (lru_cache, ...): its source
            # carries the decorator, which builds the same object there.
            self.define(name, inspect.unwrap(value), user)
        else:
            self.value(name, value, user)

    def define(self, name, obj, user):
        """``name`` bound to class or function ``obj``: imported from its module, or built from source."""
        self.seen.add(name)
        module = getattr(obj, "__module__", None)
        qualname = getattr(obj, "__qualname__", getattr(obj, "__name__", name))
        if module != "__main__":
            if not module or "<locals>" in qualname:
                raise CannotShip("%s uses %s (%r), which has no module the pods can import" % (user, name, obj))
            self.chunks.append("import importlib as _i; %s = _i.import_module(%r)%s; del _i"
                               % (name, module, "".join("." + p for p in qualname.split("."))))
            return
        if "<locals>" in qualname:
            raise CannotShip("%s uses %s, defined inside a function (%s): define it at the top level"
                             % (user, name, qualname))
        if getattr(obj, "__name__", "") == "<lambda>":
            raise CannotShip("%s uses %s, a lambda: define it with def so that its source can travel"
                             % (user, name))
        src = _source_of(obj, name, user)
        code = compile(src, "<%s>" % qualname, "exec")
        for dep in _global_names(code):
            if dep != obj.__name__:
                self.need(dep, qualname)
        self.chunks.append(src.rstrip())
        if name != getattr(obj, "__name__", name):
            self.chunks.append("%s = %s" % (name, obj.__name__))

    def value(self, name, value, user):
        try:
            data = pickle.dumps(value, protocol=4)
        except Exception as e:
            raise CannotShip("%s uses %s, a %s that cannot be pickled (%s): create it on the pods (in the "
                             "class's __init__, or pass what makes it as init arguments)"
                             % (user, name, type(value).__name__, e)) from None
        for dep in _main_refs(data):
            if dep in self.g and not dep.startswith("_"):
                self.need(dep, name)
        self.uses_values = True
        self.chunks.append("%s = _trainlet_value(%r)" % (name, base64.b64encode(data).decode()))


_VALUE_HELPER = '''\
def _trainlet_value(text):
    import base64, io, pickle, sys
    here = sys.modules[__name__]

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if module == "__main__":
                return getattr(here, name)
            return super().find_class(module, name)

    return Unpickler(io.BytesIO(base64.b64decode(text))).load()'''


def _source_of(obj, name, user):
    """The dedented source of ``obj``; for a class defined in a notebook cell on
    Python < 3.13 (where ``inspect`` cannot find it), found through its methods."""
    try:
        return textwrap.dedent(inspect.getsource(obj))
    except (OSError, TypeError) as e:
        if inspect.isclass(obj):
            found = _class_source(obj)
            if found is not None:
                return found
        raise CannotShip("%s uses %s, whose source cannot be found (%s): define it in a script or a notebook "
                         "cell, not at a plain python prompt" % (user, name, e)) from None


def _class_source(cls):
    """Where ``inspect`` cannot find a class (a notebook's ``__main__`` has no
    file): the cell that defines it, among the sources ``linecache`` holds
    (IPython keeps every cell there). The cell of one of its methods when it
    has one, else the last cell whose ``class`` statement of that name
    defines what the class has (a dataclass's generated methods have no cell)."""
    files = []
    for member in vars(cls).values():
        fn = getattr(member, "__func__", None) or getattr(member, "fget", None) or member
        code = getattr(fn, "__code__", None)
        if code is not None:
            files.append((code.co_filename, code.co_firstlineno))
    files.extend((name, None) for name in list(linecache.cache))
    found = None
    for filename, line in files:
        lines = linecache.getlines(filename)
        try:
            tree = ast.parse("".join(lines))
        except (SyntaxError, ValueError):
            continue
        for node in tree.body:
            if not (isinstance(node, ast.ClassDef) and node.name == cls.__name__):
                continue
            if line is not None and not node.lineno <= line <= node.end_lineno:
                continue
            if line is None and not _defines(node, cls):
                continue
            start = min([d.lineno for d in node.decorator_list] + [node.lineno])
            found = textwrap.dedent("".join(lines[start - 1:node.end_lineno]))
            if line is not None:
                return found
    return found


def _defines(node, cls):
    """Whether class statement ``node`` defines every name of ``cls`` it binds."""
    own = vars(cls)
    notes = own.get("__annotations__", {})
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name not in own:
            return False
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id not in notes:
            return False
    return True


def _global_names(code):
    """Every global name ``code`` (and the code nested in it) reads or writes, in
    order; not the dunders a class body reads (``__name__``), nor the names a
    class body binds itself (``x = 1; y = x``)."""
    out = []
    stack = [code]
    while stack:
        c = stack.pop(0)
        instructions = list(dis.get_instructions(c))
        own = {i.argval for i in instructions if i.opname == "STORE_NAME"} if c is not code else set()
        for ins in instructions:
            name = ins.argval
            if (ins.opname in _GLOBAL_OPS and isinstance(name, str) and name not in out and name not in own
                    and not (name.startswith("__") and name.endswith("__"))):
                out.append(name)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return out


def _main_refs(data):
    """The names of ``__main__`` a pickle refers to."""
    refs, strings = [], []
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL" and len(strings) >= 2 and strings[-2] == "__main__":
            refs.append(strings[-1].split(".")[0])
        elif op.name == "GLOBAL" and isinstance(arg, str) and arg.startswith("__main__ "):
            refs.append(arg.split(" ", 1)[1].split(".")[0])
    return refs

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
import inspect
import io
import linecache
import pickle
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


# Names a class body or a module reads that are not globals to ship.
_OWN_DUNDERS = {"__name__", "__module__", "__qualname__", "__annotations__", "__doc__", "__class__", "__dict__",
                "__builtins__", "__file__", "__spec__", "__loader__", "__package__", "__cached__"}
# A pickled value over this size is refused: it belongs in a file or on the pods.
MAX_VALUE = 16 * 1024 * 1024
_CO_OPTIMIZED = inspect.CO_OPTIMIZED
_CO_FUTURE_ANNOTATIONS = getattr(__import__("__future__"), "annotations").compiler_flag


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
    top = qualname.split(".")[0]  # a nested class travels with its outermost one
    outer = vars(main).get(top)
    if outer is None or _resolve(outer, qualname.split(".")[1:]) is not obj:
        raise CannotShip("%s is not reachable as __main__.%s (was it renamed or deleted?)" % (obj.__name__, qualname))
    builder = _Builder(vars(main))
    builder.need(top, "the actor", late=False)
    source = builder.source(qualname)
    name = PREFIX + hashlib.sha256(source.encode()).hexdigest()[:16]
    return "%s:%s" % (name, qualname), {name + ".py": source.encode()}


def _resolve(obj, parts):
    for p in parts:
        obj = getattr(obj, p, None)
    return obj


def loads(data):
    """``pickle.loads`` with the pods' shipped modules read as this ``__main__``."""
    return _MainUnpickler(io.BytesIO(data)).load()


class _MainUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module.startswith(PREFIX) and module not in sys.modules:
            module = "__main__"
        return super().find_class(module, name)


class _Recorder(pickle.Pickler):
    """A pickler that notes every class and function of ``__main__`` it
    writes by reference (its first name: ``Outer`` for ``Outer.Inner``)."""

    def __init__(self, buf):
        super().__init__(buf, protocol=4)
        self.refs = []

    def reducer_override(self, obj):
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", None) == "__main__":
            top = getattr(obj, "__qualname__", obj.__name__).split(".")[0]
            if top not in self.refs:
                self.refs.append(top)
        return NotImplemented


def _importable(value):
    """(module, name) when ``value`` is what its module calls ``name``: a function
    of ``random`` bound to its hidden generator, a builtin, a class, a constant of
    another module. None otherwise."""
    try:
        module = getattr(value, "__module__", None)
        qualname = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
    except Exception:
        return None
    if not isinstance(module, str) or not isinstance(qualname, str) or module in ("__main__", "builtins"):
        return None
    if module.startswith(PREFIX) or "<locals>" in qualname or module not in sys.modules:
        return None
    for name in (qualname, getattr(value, "__name__", None)):
        if isinstance(name, str) and _resolve(sys.modules[module], name.split(".")) is value:
            return module, name
    return None


class _Builder:
    """The module being written: its lines in dependency order. What a
    module's or a class body's code reads must exist when that code runs
    (``early``); what only a function body reads may come at the end
    (``late``), which breaks the cycles of a class whose method reads a
    value of that class."""

    def __init__(self, main_globals):
        self.g = main_globals
        self.seen = {}  # name -> the object it was bound to
        self.done = {}  # id(object) -> the name it was first defined as
        self.chunks = []  # source texts, in the order they run
        self.late = []  # values only function bodies read, after every definition
        self.uses_values = False
        self.future = False

    def source(self, what):
        head = ['"""%s, shipped from __main__ by trainlet-client (generated; do not edit)."""' % what]
        if self.future:
            head.insert(0, "from __future__ import annotations")
        head.append("import importlib as _trainlet_importlib")
        if self.uses_values:
            head.append(_VALUE_HELPER)
        return "\n\n".join(head + self.chunks + self.late) + "\n"

    def need(self, name, user, late):
        """Name ``name``, read by ``user``'s code (in a function body when
        ``late``): bind it here as ``__main__`` has it, if it has it."""
        if name in self.seen or name in _OWN_DUNDERS or name not in self.g:
            return  # done, a class body's own, a builtin or undefined: as it would be here
        value = self.g[name]
        self.seen[name] = value
        if value is getattr(builtins, name, object()):
            return
        if id(value) in self.done:  # an alias of what is defined already (or being defined)
            (self.late if late else self.chunks).append("%s = %s" % (name, self.done[id(value)]))
            return
        self.done[id(value)] = name
        if isinstance(value, types.ModuleType):
            if value.__name__ == "__main__":
                raise CannotShip("%s uses %s, which is __main__ itself" % (user, name))
            self.chunks.append("%s = _trainlet_importlib.import_module(%r)" % (name, value.__name__))
            return
        where = _importable(value)
        if where is not None:
            module, attr = where
            self.chunks.append("%s = _trainlet_importlib.import_module(%r)%s"
                               % (name, module, "".join("." + p for p in attr.split("."))))
            return
        if inspect.isclass(value) or inspect.isfunction(value):
            self.define(name, value, user)
            return
        try:
            wrapped = not inspect.isclass(value) and inspect.isfunction(inspect.unwrap(value)) and \
                getattr(inspect.unwrap(value), "__module__", None) == "__main__"
        except Exception:  # an object whose attribute lookup raises (an attribute dict)
            wrapped = False
        if wrapped:
            # A decorated function of __main__ (lru_cache, ...): its source
            # carries the decorator, which builds the same object there.
            self.define(name, inspect.unwrap(value), user)
            return
        self.value(name, value, user, late)

    def define(self, name, obj, user):
        """``name`` bound to class or function ``obj`` of ``__main__``, built from its source."""
        qualname = getattr(obj, "__qualname__", getattr(obj, "__name__", name))
        if "<locals>" in qualname:
            raise CannotShip("%s uses %s, defined inside a function (%s): define it at the top level"
                             % (user, name, qualname))
        if getattr(obj, "__name__", "") == "<lambda>":
            raise CannotShip("%s uses %s, a lambda: define it with def so that its source can travel"
                             % (user, name))
        if inspect.isclass(obj) and issubclass(obj, tuple) and hasattr(obj, "_fields"):
            return self.namedtuple(name, obj, user)
        src = _source_of(obj, name, user)
        flags = 0
        if _future_annotations(obj):
            self.future = True
            flags = _CO_FUTURE_ANNOTATIONS
        code = compile(src, "<%s>" % qualname, "exec", flags=flags, dont_inherit=True)
        early, late = _global_names(code)
        for dep in early:
            if dep != obj.__name__:
                self.need(dep, qualname, late=False)
        for dep in late:
            if dep != obj.__name__:
                self.need(dep, qualname, late=True)
        self.chunks.append(src.rstrip())
        if name != getattr(obj, "__name__", name):
            self.chunks.append("%s = %s" % (name, obj.__name__))

    def namedtuple(self, name, cls, user):
        defaults = getattr(cls, "_field_defaults", {})
        try:
            ok = all(ast.literal_eval(repr(v)) == v for v in defaults.values())
        except (ValueError, SyntaxError):
            ok = False
        if not ok:
            raise CannotShip("%s uses %s, a namedtuple whose defaults are not literals: define it as a class "
                             "(typing.NamedTuple or a dataclass) so that its source can travel" % (user, name))
        fields = list(cls._fields)
        self.chunks.append("%s = _trainlet_importlib.import_module('collections').namedtuple(%r, %r, defaults=%r)"
                           % (name, cls.__name__, fields, [defaults[f] for f in fields if f in defaults] or None))

    def value(self, name, value, user, late):
        if _is_client(value):
            raise CannotShip("%s uses %s, a trainlet client: it would carry the control token to the pods; "
                             "pass what the pods need as arguments" % (user, name))
        buf = io.BytesIO()
        recorder = _Recorder(buf)
        try:
            recorder.dump(value)
        except Exception as e:
            raise CannotShip("%s uses %s, a %s that cannot be pickled (%s): create it on the pods (in the "
                             "class's __init__, or pass what makes it as init arguments)"
                             % (user, name, type(value).__name__, e)) from None
        data = buf.getvalue()
        try:
            by_reference = isinstance(value.__reduce_ex__(4), str)
        except Exception:
            by_reference = False
        if name in recorder.refs or by_reference:
            # It pickles as a reference to itself (a TypeVar): it has no value to send.
            if type(value).__name__ == "TypeVar" and not value.__constraints__ and value.__bound__ is None:
                self.chunks.append("%s = _trainlet_importlib.import_module('typing').TypeVar(%r, covariant=%r, "
                                   "contravariant=%r)" % (name, value.__name__, value.__covariant__,
                                                          value.__contravariant__))
                return
            raise CannotShip("%s uses %s, a %s that pickles as a reference to itself: define it in a module "
                             "sent with files=" % (user, name, type(value).__name__))
        if len(data) > MAX_VALUE:
            raise CannotShip("%s uses %s, a %s of %d MiB pickled (at most %d MiB travel with the code): load it "
                             "on the pods (a file sent with files=, the dataset initializer, the model cache)"
                             % (user, name, type(value).__name__, len(data) >> 20, MAX_VALUE >> 20))
        for dep in recorder.refs:
            self.need(dep, name, late=False)
        self.uses_values = True
        (self.late if late else self.chunks).append(
            "%s = _trainlet_value(%r)" % (name, base64.b64encode(data).decode()))


def _is_client(value):
    client = sys.modules.get("trainlet_client")
    return client is not None and isinstance(value, getattr(client, "Trainlet", ()))


def _future_annotations(obj):
    """Whether ``obj``'s code was compiled under ``from __future__ import annotations``."""
    members = [obj] if inspect.isfunction(obj) else list(vars(obj).values())
    for m in members:
        fn = getattr(m, "__func__", None) or getattr(m, "fget", None) or m
        code = getattr(fn, "__code__", None)
        if code is not None and code.co_flags & _CO_FUTURE_ANNOTATIONS:
            return True
    return False


_VALUE_HELPER = """\
def _trainlet_value(text):
    import base64, functools, io, pickle, sys
    here = sys.modules[__name__]

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if module == "__main__":
                return functools.reduce(getattr, name.split("."), here)
            return super().find_class(module, name)

    return Unpickler(io.BytesIO(base64.b64decode(text))).load()"""


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
    """The global names ``code`` and the code nested in it read or write, in
    order: ``(early, late)``, those of module and class-body code (they run
    when the definition does) and those of function bodies only. Not a class
    body's dunders, nor the names a class body binds itself (``x = 1; y = x``)."""
    early, late = [], []
    stack = [code]
    while stack:
        c = stack.pop(0)
        instructions = list(dis.get_instructions(c))
        own = {i.argval for i in instructions if i.opname == "STORE_NAME"} if c is not code else set()
        into = late if c.co_flags & _CO_OPTIMIZED else early
        for ins in instructions:
            name = ins.argval
            if ins.opname in _GLOBAL_OPS and isinstance(name, str) and name not in own and name not in into:
                into.append(name)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return early, [n for n in late if n not in early]

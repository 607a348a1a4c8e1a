"""Classes and functions of ``__main__`` shipped by value (trainlet_client.ship).

Standard library only: python3 -m unittest discover -s clients/python/tests -v

Each case runs a script as ``__main__`` in a fresh interpreter, which ships
an object and writes the module file; another fresh interpreter (the pods'
side) imports that file from a directory of its own and uses the object.
"""

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

CLIENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, CLIENT)
from trainlet_client import ship  # noqa: E402

PRELUDE = "import json, sys; sys.path.insert(0, %r)\nfrom trainlet_client import ship\n" % CLIENT


def run(code, cwd):
    """Run ``code`` as ``__main__`` in ``cwd``; its stdout, or the failure."""
    script = os.path.join(cwd, "main.py")
    code = textwrap.dedent(code)
    future = ""
    if code.startswith("from __future__"):
        future, code = code.split("\n", 1)
        future += "\n"
    with open(script, "w") as f:
        f.write(future + PRELUDE + code)
    p = subprocess.run([sys.executable, script], cwd=cwd, capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        raise AssertionError("script failed:\n%s" % p.stderr)
    return p.stdout


def ship_in_script(code, obj):
    """Ship ``obj`` (a name) from a script of ``code``: (target, {file: source})."""
    tmp = tempfile.mkdtemp()
    out = run(code + textwrap.dedent("""
        target, files = ship.shipped(%s)
        print(json.dumps([target, {k: v.decode() for k, v in files.items()}]))
        """ % obj), tmp)
    target, files = json.loads(out.splitlines()[-1])
    return target, files


def on_the_pods(target, files, use):
    """Import ``target`` from ``files`` in a fresh interpreter (as the worker
    runtime does) as ``obj``, run ``use`` and return what it prints."""
    pods = tempfile.mkdtemp()
    for name, text in files.items():
        with open(os.path.join(pods, name), "w") as f:
            f.write(text)
    module, _, attr = target.partition(":")
    code = "import importlib, json\nobj = importlib.import_module(%r)\nfor p in %r.split('.'):\n" \
           "    obj = getattr(obj, p)\n" % (module, attr) + textwrap.dedent(use)
    p = subprocess.run([sys.executable, "-c", code], cwd=pods, capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        raise AssertionError("on the pods:\n%s\n--- module:\n%s" % (p.stderr, "\n".join(files.values())))
    return p.stdout


TRAINER = """
import functools, json, socket
from dataclasses import dataclass, field
from os.path import join as joined
import os.path as osp

SCALE = {"a": 2}

@dataclass
class Cfg:
    lr: float = 0.1
    tags: list = field(default_factory=list)

DEFAULT = Cfg(lr=0.5, tags=["x"])

def helper(x):
    return x * SCALE["a"]

@functools.lru_cache(maxsize=None)
def cached(n):
    return n + 1

class Base:
    def hello(self):
        return joined("base", osp.basename("/a/b"))

model = socket.socket()  # read only as self.model below: not shipped

class Trainer(Base):
    kind = "t"
    doubled = kind * 2

    def __init__(self, cfg=None):
        self.cfg = cfg or DEFAULT
        self.model = 3

    def step(self, x):
        return helper(x) + cached(1) + self.cfg.lr + self.model

    def make(self):
        return Cfg(lr=self.cfg.lr * 2)
"""


class Shipped(unittest.TestCase):
    def test_a_class_travels_with_what_it_uses_from_main(self):
        target, files = ship_in_script(TRAINER, "Trainer")
        module, _, attr = target.partition(":")
        self.assertTrue(module.startswith(ship.PREFIX), target)
        self.assertEqual(attr, "Trainer")
        self.assertEqual(list(files), [module + ".py"])
        out = on_the_pods(target, files, """
            t = obj()
            print(json.dumps([t.step(2), t.hello(), repr(t.make()), repr(t.cfg), obj.doubled]))
            """)
        self.assertEqual(json.loads(out), [4 + 2 + 0.5 + 3, "base/b", "Cfg(lr=1.0, tags=[])",
                                           "Cfg(lr=0.5, tags=['x'])", "tt"])
        self.assertNotIn("socket", files[module + ".py"], "self.model is an attribute, not the global")

    def test_the_file_is_named_by_its_content(self):
        a, _ = ship_in_script(TRAINER, "Trainer")
        b, _ = ship_in_script(TRAINER, "Trainer")
        c, _ = ship_in_script(TRAINER.replace('"a": 2', '"a": 3'), "Trainer")
        self.assertEqual(a, b)
        self.assertNotEqual(a, c, "a changed value is a new module")

    def test_a_function_travels_and_a_module_class_goes_by_name(self):
        target, files = ship_in_script(TRAINER + "\ndef score(x):\n    return helper(x) * 10\n", "score")
        self.assertEqual(on_the_pods(target, files, "print(obj(4))").strip(), "80")
        self.assertEqual(ship.shipped(json.JSONDecoder), ("json.decoder:JSONDecoder", {}))

    def test_pickles_that_name_the_shipped_module_are_read_as_main_here(self):
        target, files = ship_in_script(TRAINER, "Trainer")
        out = on_the_pods(target, files, """
            import base64, pickle
            print(base64.b64encode(pickle.dumps(obj().make())).decode())
            """)
        code = """
            import base64
            %s
            back = ship.loads(base64.b64decode(%r))
            print(type(back) is Cfg, back.lr)
            """ % (TRAINER.replace("\n", "\n            "), out.strip())
        self.assertEqual(run(code, tempfile.mkdtemp()).split(), ["True", "1.0"])

    def test_common_notebook_patterns_build_the_same_objects_there(self):
        # (code, what is shipped, what the pods run, what they print)
        cases = {
            "two classes in one value (pickle's memo)":
                ("class A: v=1\nclass B: v=2\nPAIR = (A(), B())\ndef go(): return PAIR[0].v + PAIR[1].v\n",
                 "go", "print(obj())", "3"),
            "a method reads a value of its own class":
                ("class Config:\n    def __init__(self, v): self.v = v\n    @classmethod\n"
                 "    def default(cls): return DEFAULT\nDEFAULT = Config(5)\n",
                 "Config", "print(obj.default().v)", "5"),
            "a partial of a function that reads it":
                ("import functools\ndef f(n):\n    return n if n > 3 else g(n + 1)\ng = functools.partial(f)\n",
                 "f", "print(obj(0))", "4"),
            "a TypeVar and a generic class":
                ("from typing import TypeVar, Generic\nT = TypeVar('T')\nclass Box(Generic[T]):\n"
                 "    def __init__(self, x): self.x = x\n", "Box", "print(obj(3).x)", "3"),
            "an alias is the same class":
                ("class Cfg:\n    pass\nConfig = Cfg\nDEFAULT = Cfg()\nclass U:\n"
                 "    def go(self): return [isinstance(DEFAULT, Config), isinstance(DEFAULT, Cfg)]\n",
                 "U", "print(obj().go())", "[True, True]"),
            "private names": ("class _Cfg:\n    v = 7\n_DEFAULT = _Cfg()\ndef go(): return _DEFAULT.v\n",
                              "go", "print(obj())", "7"),
            "from __future__ import annotations":
                ("from __future__ import annotations\nclass Node:\n    def clone(self) -> Node: return Node()\n",
                 "Node", "print(type(obj().clone()).__name__)", "Node"),
            "a nested class": ("class Outer:\n    class Inner:\n        def go(self): return 'in'\n",
                               "Outer.Inner", "print(obj().go())", "in"),
            "random's functions are imported, not copied":
                ("from random import randint\nimport random\ndef go():\n    random.seed(0); a = randint(0, 10**9)\n"
                 "    random.seed(0); return a == randint(0, 10**9)\n", "go", "print(obj())", "True"),
            "an attribute dict": ("class AttrDict(dict):\n    __getattr__ = dict.__getitem__\ncfg = AttrDict(a=1)\n"
                                  "def go(): return cfg['a']\n", "go", "print(obj())", "1"),
            "a namedtuple": ("from collections import namedtuple\nP = namedtuple('P', ['x', 'y'], defaults=[0])\n"
                             "def go(): return P(1)\n", "go", "print(tuple(obj()))", "(1, 0)"),
            "an enum, a staticmethod, a property":
                ("import enum\nclass Color(enum.Enum):\n    RED = 1\nclass A:\n    @staticmethod\n"
                 "    def s(): return helper()\n    @property\n    def p(self): return Color.RED.value\n"
                 "def helper(): return 2\n", "A", "print(obj.s() + obj().p)", "3"),
        }
        for what, (code, name, use, want) in cases.items():
            target, files = ship_in_script(code, name)
            self.assertEqual(on_the_pods(target, files, use).strip(), want, what)

    def test_what_cannot_travel_is_refused_with_the_reason(self):
        cases = {
            "pick = lambda: 1\nclass A:\n    def go(self):\n        return pick()\n": ("A", "a lambda"),
            "import threading\nlock = threading.Lock()\nclass A:\n    def go(self):\n        return lock\n":
                ("A", "lock, a lock that cannot be pickled"),
            "def make():\n    class Inner:\n        pass\n    return Inner\nInner = make()\n":
                ("Inner", "inside a function"),
            "exec(compile('class A:\\n    def go(self):\\n        return 1\\n', '<stdin>', 'exec'))\n":
                ("A", "source cannot be found"),
            "import sys\nme = sys.modules[__name__]\nclass A:\n    def go(self):\n        return me\n":
                ("A", "__main__ itself"),
            "from trainlet_client import Trainlet\nt = Trainlet('http://127.0.0.1:1', 'secret')\n"
            "class A:\n    def go(self):\n        return t\n": ("A", "control token"),
            "BIG = b'x' * (17 << 20)\nclass A:\n    def go(self):\n        return BIG\n": ("A", "at most 16 MiB"),
        }
        for code, (name, words) in cases.items():
            tmp = tempfile.mkdtemp()
            out = run(code + textwrap.dedent("""
                try:
                    ship.shipped(%s)
                    print("shipped")
                except ship.CannotShip as e:
                    print(e)
                """ % name), tmp)
            self.assertIn(words, out, code)
        with self.assertRaises(TypeError):
            ship.shipped(42)


if __name__ == "__main__":
    unittest.main()

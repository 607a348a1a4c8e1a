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

PRELUDE = "import sys; sys.path.insert(0, %r)\nfrom trainlet_client import ship\n" % CLIENT


def run(code, cwd):
    """Run ``code`` as ``__main__`` in ``cwd``; its stdout, or the failure."""
    script = os.path.join(cwd, "main.py")
    with open(script, "w") as f:
        f.write(PRELUDE + textwrap.dedent(code))
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

"""Drive examples/actor/trainer.py as an actor on warm pods.

Start local serving pods first (as examples/run.sh builds trainlet):

    TRAINLET_PYTHON=$PWD/.venv/bin/python target/x86_64-unknown-linux-gnu/release/trainlet \
        run --serve --standalone --preload torch --nproc-per-node 2 &
    python3 examples/actor_driver.py      # --url and --token-file default to that pod's

Every worker instantiates Trainer once; each call below runs on every rank and
the model stays in the workers' memory between calls. With --survivors, the
last rank is then killed: only it restarts, the others keep their state.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "clients", "python"))
from trainlet_client import ActorError, Trainlet  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--url", default=os.environ.get("TRAINLET_URL", "http://127.0.0.1:29400"))
    p.add_argument("--token-file", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "trainlet-serve", "control-token"))
    p.add_argument("--nproc-per-node", type=int)
    p.add_argument("--logs", action="store_true", help="copy every rank's lines to stdout")
    p.add_argument("--survivors", action="store_true", help="restart='survivors', then kill the last rank")
    args = p.parse_args()
    with open(args.token_file) as f:
        t = Trainlet(args.url, f.read())

    # Upload examples/actor/, instantiate Trainer(width=32) on every worker, wait until all are up.
    restart = "survivors" if args.survivors else "all"
    with t.actor("trainer:Trainer", files=os.path.join(HERE, "actor"), init_kwargs={"width": 32},
                 nproc_per_node=args.nproc_per_node, logs=sys.stdout if args.logs else None,
                 restart=restart, max_restarts=1 if args.survivors else None) as a:
        print("actor", a.id)
        print("setup:", a.setup(lr=0.05))                 # a list: every rank's result, rank order
        for epoch in range(3):
            r = a.train.rank0(steps=20)                   # every rank trains; rank 0's result
            print("epoch %d: step %d loss %.4f" % (epoch, r["steps"], r["loss"]))
        states = a.state()
        assert len({s["checksum"] for s in states}) == 1, states   # DDP kept the ranks identical
        print("state:", states)
        print("evaluate:", a.evaluate.rank0())
        try:
            a.train(steps=0)                              # raises ValueError on every rank
        except ActorError as e:
            print("train(steps=0) failed as expected: %s on rank %s: %s" % (e.type, e.rank, e.error["message"]))
        print("still there:", a.state.rank0())            # an exception in a method leaves the actor alive
        if args.survivors:
            last = len(states) - 1
            try:
                a.crash(rank=last)
            except ActorError as e:                       # WorkerDied on the last rank
                print("crash(%d): %s on rank %s" % (last, e.type, e.rank))
            print("after:", a.state())                    # the survivors' steps are kept; the new rank has 0
            a.setup(lr=0.05)                              # the fresh rank needs its optimizer too
            print("trained on:", a.train.rank0(steps=5))
            after = a.state()
            assert len({s["checksum"] for s in after}) == 1, after
    return 0


if __name__ == "__main__":
    sys.exit(main())

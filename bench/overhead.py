"""What importing tapehook costs unmarked eager code: small TF ops, per call.

Each state runs in its own process (a process that imported tapehook cannot
un-import it): ``stock`` never imports tapehook, ``imported`` imports it and
marks nothing, ``marked_elsewhere`` imports it and marks a variable the ops
never use. The states alternate, ``--rounds`` times each; per op the best of
``--repeats`` x ``--calls`` calls is a process's number, and the table shows
min and median over rounds plus the difference to stock. Target (issue #15):
within 1 us of stock while nothing is marked, within 2 us with marks
elsewhere.

    python bench/overhead.py            # writes bench/results/overhead.json
"""

import argparse
import json
import pathlib
import statistics
import subprocess
import sys

STATES = ("stock", "imported", "marked_elsewhere")
OPS = ("tf.matmul 4x4", "tf.identity", "tf.cast", "Variable.read_value()", "tf.nn.conv2d 1x8x8x4")

_CHILD = r"""
import json, os, sys, timeit
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf
state, calls, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if state != "stock":
    import tapehook
    if state == "marked_elsewhere":
        tapehook.mark_binary(tf.Variable(tf.ones([3, 3, 4, 4])), activations=True)
a = tf.random.normal([4, 4])
v = tf.Variable(a)
x = tf.random.normal([1, 8, 8, 4])
f = tf.random.normal([3, 3, 4, 4])
ops = {
    "tf.matmul 4x4": lambda: tf.matmul(a, a),
    "tf.identity": lambda: tf.identity(a),
    "tf.cast": lambda: tf.cast(a, tf.float64),
    "Variable.read_value()": lambda: v.read_value(),
    "tf.nn.conv2d 1x8x8x4": lambda: tf.nn.conv2d(x, f, 1, "SAME"),
}
result = {}
for name, op in ops.items():
    op()
    best = min(timeit.repeat(op, number=calls, repeat=repeats))
    result[name] = best / calls * 1e6
print(json.dumps(result))
"""


def _run_state(state, calls, repeats):
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, state, str(calls), str(repeats)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--out", default=str(pathlib.Path(__file__).parent / "results" / "overhead.json")
    )
    args = parser.parse_args()
    runs = {state: [] for state in STATES}
    for round_ in range(args.rounds):
        order = STATES if round_ % 2 == 0 else tuple(reversed(STATES))
        for state in order:
            runs[state].append(_run_state(state, args.calls, args.repeats))
    table = {}
    for op in OPS:
        row = {}
        for state in STATES:
            values = [r[op] for r in runs[state]]
            row[state] = {"min_us": min(values), "median_us": statistics.median(values)}
        for state in STATES[1:]:
            row[state]["delta_min_us"] = row[state]["min_us"] - row["stock"]["min_us"]
            row[state]["delta_median_us"] = row[state]["median_us"] - row["stock"]["median_us"]
        table[op] = row
    result = {"calls": args.calls, "repeats": args.repeats, "rounds": args.rounds, "table": table}
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'eager op':24} {'stock us':>12} {'imported':>20} {'marked elsewhere':>20}")
    for op, row in table.items():
        cells = [f"{row['stock']['min_us']:5.1f}/{row['stock']['median_us']:5.1f}"]
        for state in STATES[1:]:
            cells.append(
                f"{row[state]['min_us']:5.1f} ({row[state]['delta_min_us']:+4.1f})"
                f"/{row[state]['delta_median_us']:+4.1f}"
            )
        print(f"{op:24} {cells[0]:>12} {cells[1]:>20} {cells[2]:>20}")
    print("us per call: min/median over rounds; (delta to stock by min)/delta by median")


if __name__ == "__main__":
    main()

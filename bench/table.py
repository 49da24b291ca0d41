"""Prints the README's speed table (markdown) from a bench/run.py JSON file.

    python bench/table.py [bench/results/latest.json]
"""

import json
import pathlib
import sys

ROWS = [("forward_binary", "fully binary forward"),
        ("forward_binary_graph", "fully binary forward, per conv of a graph"),
        ("forward_weight_only", "weight-only forward (inference)"),
        ("step_binary", "fully binary training step"),
        ("step_weight_only", "weight-only training step"),
        ("kernel_forward_weight_only", "weight-only forward kernel"),
        ("kernel_backprop_input", "backprop-input kernel"),
        ("kernel_backprop_filter", "backprop-filter kernel (binary x)")]


def main(path):
    data = json.loads(pathlib.Path(path).read_text())
    blocks = data["results"]
    shapes = list(dict.fromkeys(r["shape"] for r in blocks[0]["rows"]))
    flags = ", ".join(data["cpu_flags"])
    print(f"Measured {data['date']} on {data['cpu_model']} ({data['cpu_count']} cores; "
          f"flags {flags}), TF {blocks[0]['tf_version']}, AMX kernels "
          f"{'on' if blocks[0].get('amx_kernels') else 'off'}; speedup = stock time / "
          f"tapehook time by median of {data['args']['reps']} interleaved reps "
          "(min-based in parentheses).\n")
    print("| oneDNN | comparison | " + " | ".join(shapes) + " |")
    print("|---|---|" + "---|" * len(shapes))
    for block in blocks:
        by_key = {(r["comparison"], r["shape"]): r for r in block["rows"]}
        for key, label in ROWS:
            cells = []
            for shape in shapes:
                r = by_key.get((key, shape))
                cells.append("-" if r is None else
                             f"{r['speedup_median']:.2f}x ({r['speedup_min']:.2f})")
            print(f"| {block['onednn']} | {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else
         pathlib.Path(__file__).resolve().parent / "results" / "latest.json")

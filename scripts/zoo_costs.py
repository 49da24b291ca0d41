"""The cost table of docs/guides/zoo.md: each tapehook.zoo model at 224 px
(with its ImageNet top) as tapehook.summary counts it, beside what larq-zoo's
docstrings and the papers publish.

    python scripts/zoo_costs.py          # rewrites the table in the guide
    python scripts/zoo_costs.py --check  # fails if the guide's table is stale
"""

import argparse
import pathlib
import sys

import tapehook
from tapehook import zoo

GUIDE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "guides" / "zoo.md"
START, END = "<!-- zoo-costs:start -->", "<!-- zoo-costs:end -->"

# Published facts: larq-zoo 2.4's docstring tables (ImageNet top-1, parameters,
# memory in MB) and, where a paper gives one, its OPs (FLOPs + BOPs / 64);
# ReActNet-A (not in larq-zoo): its paper's top-1 and OPs.
PUBLISHED = {
    "QuickNetSmall": ("59.4 %", "12,655,688", "4.00"),
    "QuickNet": ("63.3 %", "13,234,088", "4.17"),
    "QuickNetLarge": ("66.9 %", "23,342,248", "5.40"),
    "BiRealNet": ("57.47 %", "11,699,112", "4.03", "1.63e8 (Liu et al. 2018)"),
    "RealToBinaryNet": ("65.01 %", "11,995,624", "5.13"),
    "BinaryResNetE18": ("58.32 %", "11,699,368", "4.03"),
    "BinaryDenseNet28": ("60.91 %", "5,150,504", "4.12"),
    "BinaryDenseNet37": ("62.89 %", "8,734,120", "5.25"),
    "BinaryDenseNet37Dilated": ("64.34 %", "8,734,120", "5.25"),
    "BinaryDenseNet45": ("64.59 %", "13,939,240", "7.54"),
    "MeliusNet22": ("62.4 %", "", ""),
    "XNORNet": ("44.96 %", "62,396,768", "22.81"),
    "DoReFaNet": ("53.39 %", "62,403,912", "22.84"),
    "BinaryAlexNet": ("36.30 %", "61,859,192", "7.49"),
    "ReActNetA": ("69.4 % (paper)", "", "", "0.87e8 (Liu et al. 2020)"),
}


def _e(n):
    return f"{n:.2e}".replace("e+0", "e")


def rows():
    lines = [
        "| model | parameters | larq-zoo docs | binary MACs | float MACs | OPs | paper OPs "
        "| memory at 1 bit (MiB) | larq-zoo docs (MB) | top-1 (larq-zoo) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in (*zoo.MODELS, *zoo.EXTRA_MODELS):
        totals = tapehook.summary(getattr(zoo, name)(), print_fn=None).totals
        top1, params, memory, *paper = PUBLISHED[name]
        lines.append(
            f"| `{name}` | {totals['params']:,} | {params} | {_e(totals['binary_macs'])} "
            f"| {_e(totals['float_macs'])} | {_e(totals['ops'])} | {paper[0] if paper else ''} "
            f"| {totals['binarized_bytes'] / 2**20:.2f} | {memory} | {top1} |"
        )
    return "\n".join(lines)


def render(text, table):
    head, rest = text.split(START)
    _, tail = rest.split(END)
    return f"{head}{START}\n{table}\n{END}{tail}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    text = GUIDE.read_text()
    new = render(text, rows())
    if args.check:
        if new != text:
            sys.exit(f"{GUIDE} is stale: run python scripts/zoo_costs.py")
        return
    GUIDE.write_text(new)


if __name__ == "__main__":
    main()

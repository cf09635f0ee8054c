"""Per-module mutation score of the last `make mutation` run (mutmut's results in mutants/).

Counts only the mutants that were checked (the Makefile's MUTANTS select functions; the rest of
each file stays "not checked"); score = killed / (killed + survived + timeout). Lists the
survivors, for `mutmut show NAME`.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from mutmut.stats import status_by_exit_code


def main(root: Path = Path("mutants")) -> int:
    metas = sorted(root.rglob("*.py.meta"))
    if not metas:
        print(f"no mutmut results under {root}/ (run `make mutation` first)", file=sys.stderr)
        return 1
    print(f"{'module':<26}{'total':>7}{'killed':>8}{'survived':>10}{'timeout':>9}{'other':>7}"
          f"{'score':>8}")
    survivors: list[str] = []
    for meta in metas:
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        statuses = {name: status_by_exit_code[code] for name, code in codes.items()}
        checked = {n: s for n, s in statuses.items() if s != "not checked"}
        if not checked:
            continue
        count = Counter(checked.values())
        judged = count["killed"] + count["survived"] + count["timeout"]
        other = len(checked) - judged
        score = f"{100 * count['killed'] / judged:.1f}%" if judged else "-"
        module = str(meta.relative_to(root)).removesuffix(".meta")
        print(f"{module:<26}{len(checked):>7}{count['killed']:>8}{count['survived']:>10}"
              f"{count['timeout']:>9}{other:>7}{score:>8}")
        survivors += sorted(n for n, s in checked.items() if s != "killed")
    if survivors:
        print("\nnot killed (`mutmut show NAME`):")
        for name in survivors:
            print(f"  {name}: {statuses_of(root, name)}")
    return 0


def statuses_of(root: Path, name: str) -> str:
    module = name.split(".x")[0].replace(".", "/")
    codes = json.loads((root / f"{module}.py.meta").read_text())["exit_code_by_key"]
    return status_by_exit_code[codes[name]]


if __name__ == "__main__":
    sys.exit(main())

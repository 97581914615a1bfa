"""The closing table of a many-model run, and its one exit code."""

from __future__ import annotations

from collections import Counter

from lnfuse.terminal import block, escape
from lnfuse.zoo.job import OK
from lnfuse.zoo.limits import size_text


def exit_code(rows: list[dict]) -> int:
    """The worst model's, as a run of that model alone ends: 0 written (candidates left included: ``lnfuse check``
    is the gate for those), 1 a difference found (nothing written), 2 a bad input (including one over its time or
    memory limit), 3 an internal error."""
    return max((row["exit"] for row in rows), default=OK)


def closing_table(rows: list[dict], *, wall: float, resumed: int = 0, verbose: bool = False) -> str:
    """Totals (models by outcome, fused per op, refused candidates, seconds, bytes in and out), then one line per
    model that was not fused whole (every model with ``verbose``), saying why. Only the ``this run:`` line
    differs between a run and its resumption. Every name and reason in it is escaped (``lnfuse.terminal``): the
    text's only line breaks are its own."""
    statuses = Counter(row["status"] for row in rows)
    fused: Counter[str] = Counter()
    for row in rows:
        fused.update(row["fused"])
    lines = [f"models: {len(rows)}  " + "  ".join(f"{status}: {count}" for status, count in sorted(
        statuses.items(), key=lambda item: _ORDER.get(item[0], 9)))]
    if fused:
        lines += ["", f"{'fused op':<34} {'count':>7} {'models':>7}"]
        for op, count in sorted(fused.items(), key=lambda item: (-item[1], item[0])):
            lines.append(f"{escape(op):<34} {count:>7} {sum(1 for r in rows if op in r['fused']):>7}")
    refused = sum(row["refused"] for row in rows)
    bytes_in, bytes_out = sum(r["bytes_in"] for r in rows), sum(r["bytes_out"] for r in rows)
    lines += ["", f"refused candidates: {refused} in {sum(1 for r in rows if r['refused'])} model(s)",
              f"seconds: {sum(r['seconds'] for r in rows):.1f} in the models; bytes in {size_text(bytes_in)}, "
              f"out {size_text(bytes_out)}",
              f"this run: {wall:.1f} s wall" + (f", {resumed} model(s) taken from the ledger" if resumed else "")]
    shown = [row for row in rows if verbose or row["exit"] != OK or row["status"] not in _DONE]
    if shown:
        shown.sort(key=lambda r: (-r["exit"], r["model"]))
        width = min(max(len(escape(r["model"])) for r in shown), 60)
        lines += ["", f"{'exit':<4} {'status':<15} {'seconds':>8}  {'model':<{width}}  reason"]
        lines += [f"{r['exit']:<4} {r['status']:<15} {r['seconds']:>8.2f}  {escape(r['model']):<{width}}  "
                  f"{r['reason']}" for r in shown]
    return block(lines)


#: outcomes with nothing to say: every candidate fused, or none found
_DONE = frozenset({"fused", "nothing to fuse"})
_ORDER = {"fused": 0, "nothing to fuse": 1, "candidates left": 2, "differs": 3, "bad input": 4, "timeout": 5,
          "over memory": 6, "internal error": 7, "worker died": 8}

"""Print an Nsight Compute --csv file (one metric per line) as a table: a row per
kernel launch, a column per metric.

Usage: python3 benchmarks/_ncu_table.py ncu.csv [kernel-name substring]
"""
import collections
import csv
import sys


def short(name: str) -> str:
    return (name.replace("smsp__average_warps_issue_stalled_", "stall_").replace("_per_issue_active.ratio", "")
            .replace(".avg.pct_of_peak_sustained_active", "%").replace(".avg.pct_of_peak_sustained_elapsed", "%")
            .replace("l1tex__t_", "").replace("_pipe_lsu_mem_global_op_ld.sum", "_ld"))


def main(path: str, want: str = "") -> None:
    rows = list(csv.reader(open(path)))
    rows = rows[next((i for i, r in enumerate(rows) if r[:1] == ["ID"]), len(rows)):]   # skip the program's prints
    if not rows:
        sys.exit(f"{path}: ncu wrote no kernel rows")
    hdr = rows[0]
    ii, ki, mi, vi = (hdr.index(c) for c in ("ID", "Kernel Name", "Metric Name", "Metric Value"))
    by = collections.OrderedDict()
    for r in rows[1:]:
        if want in r[ki]:
            by.setdefault((r[ii], r[ki][:40]), {})[r[mi]] = r[vi]
    names = list(next(iter(by.values())).keys()) if by else []
    print(f"{'kernel':<45}" + "  ".join(short(n) for n in names))
    for (i, k), m in by.items():
        print(f"{i:>4} {k:<40}" + "  ".join(str(m.get(n, "")) for n in names))


if __name__ == "__main__":
    main(*sys.argv[1:3])

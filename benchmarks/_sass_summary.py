"""Instruction mix of a kernel from Nsight Compute's source page: warp instructions
executed per SASS opcode, summed over the kernel (e.g. whether a kernel's multiply-adds
compiled to FFMA or to separate FADD / FMUL).

Usage: python benchmarks/_sass_summary.py SASS.csv, where SASS.csv comes from
  ncu --profile-from-start off --clock-control none --section SourceCounters -o rep \
      python3 benchmarks/trace_writes.py --profile compress:131072
  ncu --import rep.ncu-rep --page source --print-source sass --csv > SASS.csv
(benchmarks/gpu.sh, step ncu).
"""
import csv, sys, collections, re
rows = list(csv.reader(open(sys.argv[1], errors="replace")))
hi = next((i for i, r in enumerate(rows) if any("Source" == c.strip() for c in r)), None)
if hi is None:
    print("no header; first lines:"); [print(r[:8]) for r in rows[:10]]; sys.exit()
hdr = rows[hi]; print("columns:", hdr[:12])
si = hdr.index("Source")
ei = next(i for i, c in enumerate(hdr) if c.startswith("Instructions Executed") or c.startswith("Warp Instructions Executed"))
ops = collections.Counter(); total = 0; nrows = 0
for r in rows[hi + 1:]:
    if len(r) <= max(si, ei): continue
    try: n = float(r[ei].replace(",", ""))
    except ValueError: continue
    src = r[si].strip()
    src = re.sub(r"^@!?U?P\w+\s+", "", src)
    op = src.split(" ")[0].split(".")[0] if src else "?"
    ops[op] += n; total += n; nrows += 1
print(f"{nrows} SASS lines, {total:,.0f} warp instructions executed")
for op, n in ops.most_common(40):
    print(f"  {op:<12}{n:>16,.0f}{n / total:>8.1%}")

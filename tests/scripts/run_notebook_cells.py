"""Run every notebook's code cells in one Python process, in order (for the GPU machine).

Usage: python tests/scripts/run_notebook_cells.py [NOTEBOOK ...]   (default: notebooks/*.ipynb)

tests/test_notebooks.py executes the notebooks through a Jupyter kernel (nbclient),
which the GPU machine does not have (no nbformat, no ipykernel, no network). The
notebooks use no magics, so their code cells run here as plain Python, each
notebook in a fresh namespace with notebooks/ as the working directory and a
non-interactive matplotlib backend. Prints 'NOTEBOOK <name>: OK' per notebook and
exits 1 at the first cell that raises (with the cell's index and traceback).
"""
import json
import os
import pathlib
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[2]


def main(paths) -> int:
    os.environ.setdefault("MPLBACKEND", "Agg")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT / "notebooks")
    for path in paths:
        cells = [c for c in json.loads(pathlib.Path(path).read_text())["cells"] if c["cell_type"] == "code"]
        ns = {"__name__": "__main__"}
        t0 = time.perf_counter()
        for i, cell in enumerate(cells):
            src = "".join(cell["source"])
            try:
                exec(compile(src, f"{pathlib.Path(path).name}[cell {i}]", "exec"), ns)
            except Exception:
                print(f"NOTEBOOK {pathlib.Path(path).name}: cell {i} raised\n{src}\n{traceback.format_exc()}")
                return 1
        print(f"NOTEBOOK {pathlib.Path(path).name}: OK ({len(cells)} code cells, {time.perf_counter() - t0:.1f} s)",
              flush=True)
    return 0


if __name__ == "__main__":
    args = [str(pathlib.Path(p).resolve()) for p in sys.argv[1:]]
    sys.exit(main(args or sorted(str(p) for p in (ROOT / "notebooks").glob("*.ipynb"))))

"""Executes a notebook papermill-style with nbclient: the cell tagged ``parameters`` keeps its
defaults and a new cell right after it overrides them (as papermill's ``injected-parameters``).

From the repository root (what the README's results were produced with; no override = the
notebook's full setting)::

    python -m tests.notebooks.nbrun notebooks/ideator.ipynb runs/ideator.executed.ipynb \
        [-p 'rl_steps=4' -p 'eval_seeds=(0,)' ...]
"""
from __future__ import annotations

import argparse
import ast
import os
import time
from typing import Any, Mapping

import nbformat
from nbclient import NotebookClient

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def inject_parameters(nb, params: Mapping[str, Any]):
    """Inserts ``name = repr(value)`` lines after the ``parameters`` cell (ValueError if none)."""
    idx = next((i for i, c in enumerate(nb.cells)
                if "parameters" in c.get("metadata", {}).get("tags", [])), None)
    if idx is None:
        raise ValueError("the notebook has no cell tagged 'parameters'")
    src = "# Parameters injected by the test\n" + "\n".join(
        f"{k} = {v!r}" for k, v in params.items())
    cell = nbformat.v4.new_code_cell(src, metadata={"tags": ["injected-parameters"]})
    nb.cells.insert(idx + 1, cell)
    return nb


def run_notebook(path: str, params: Mapping[str, Any], out_path: str, *, timeout_s: int = 900):
    """Runs ``path`` from the repository root with ``params``; writes the executed copy to
    ``out_path`` (also on failure, for the traceback) and returns the executed notebook."""
    nb = nbformat.read(path, as_version=4)
    inject_parameters(nb, params)
    client = NotebookClient(nb, timeout=timeout_s, kernel_name="python3",
                            resources={"metadata": {"path": REPO}})
    try:
        client.execute()
    finally:
        nbformat.write(nb, out_path)
    return nb


def outputs_text(nb) -> str:
    """All stream and text/plain outputs of the notebook, concatenated."""
    parts = []
    for c in nb.cells:
        for o in c.get("outputs", []):
            if o.get("output_type") == "stream":
                parts.append(o.get("text", ""))
            elif "data" in o and "text/plain" in o["data"]:
                parts.append(o["data"]["text/plain"])
    return "\n".join(parts)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Execute a notebook with its parameters overridden.")
    ap.add_argument("notebook")
    ap.add_argument("out", help="where the executed notebook is written")
    ap.add_argument("-p", "--param", action="append", default=[], metavar="NAME=LITERAL",
                    help="a parameter override; the value is a Python literal")
    ap.add_argument("--cell_timeout_s", type=int, default=6 * 3600)
    args = ap.parse_args(argv)
    params = {}
    for item in args.param:
        name, sep, value = item.partition("=")
        if not sep or not name.isidentifier():
            ap.error(f"-p {item!r}: expected NAME=LITERAL")
        try:
            params[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            ap.error(f"-p {item!r}: {value!r} is not a Python literal")
    t0 = time.time()
    nb = run_notebook(args.notebook, params, args.out, timeout_s=args.cell_timeout_s)
    print(outputs_text(nb)[-4000:])
    print(f"executed {args.notebook} in {(time.time() - t0) / 60:.1f} min -> {args.out}")


if __name__ == "__main__":
    main()

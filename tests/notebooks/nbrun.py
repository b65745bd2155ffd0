"""Executes a notebook papermill-style with nbclient: the cell tagged ``parameters`` keeps its
defaults and a new cell right after it overrides them (as papermill's ``injected-parameters``)."""
from __future__ import annotations

import os
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

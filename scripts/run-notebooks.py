"""Executes the tutorial notebooks headless with the ART kernel, as a reader would run them.

    ART_KERNEL_BIN=target/debug/art-kernel .venv/bin/python scripts/run-notebooks.py [--write] [NOTEBOOK ...]

Fails on the first cell whose output is an error (a compile error, a panic, a failed `?`), and checks
that notebook 3's trained reward beats its base reward, read from its printed output. `--write` saves
the outputs into the notebook files (to refresh the committed outputs); without it the files are left
as they are. The kernelspec is installed into a temporary prefix; the build cache is the kernel's
usual one (ART_KERNEL_CACHE or ~/.cache/art-kernel), so a cold machine spends minutes warming it.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "notebooks")
TRAINED = re.compile(r"held-out reward: base ([0-9.]+) -> trained ([0-9.]+)")


def outputs_text(notebook):
    """Everything the notebook printed (streams and plain-text results)."""
    parts = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream":
                parts.append(output.get("text", ""))
            elif "data" in output:
                parts.append(output["data"].get("text/plain", ""))
    return "".join(parts)


def error_outputs(notebook):
    return [
        (index, output)
        for index, cell in enumerate(notebook.cells)
        for output in cell.get("outputs", [])
        if output.get("output_type") == "error"
    ]


def check_training(name, notebook):
    """Notebook 3 must show training beating the base model."""
    if not name.startswith("03-"):
        return
    found = TRAINED.search(outputs_text(notebook))
    if not found:
        raise AssertionError(f"{name}: no 'held-out reward: base X -> trained Y' line in its outputs")
    base, trained = float(found.group(1)), float(found.group(2))
    if not trained > base:
        raise AssertionError(f"{name}: trained reward {trained} does not beat base {base}")
    print(f"  {name}: held-out reward base {base} -> trained {trained}")


def run(path, write, timeout):
    name = os.path.basename(path)
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        kernel_name="art",
        timeout=timeout,
        startup_timeout=600,
        resources={"metadata": {"path": os.path.dirname(path)}},
    )
    started = time.monotonic()
    try:
        client.execute()
    except CellExecutionError as error:
        if write:
            nbformat.write(notebook, path)
        raise SystemExit(f"{name} failed:\n{error}")
    if write:
        nbformat.write(notebook, path)
    errors = error_outputs(notebook)
    if errors:
        index, output = errors[0]
        raise SystemExit(f"{name}: cell {index} has an error output: {output.get('evalue')}")
    check_training(name, notebook)
    print(f"  {name}: ok in {time.monotonic() - started:.0f} s", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", help="default: every notebooks/*.ipynb")
    parser.add_argument("--write", action="store_true", help="save the outputs into the files")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds a cell may take")
    args = parser.parse_args()
    paths = args.notebooks or sorted(
        os.path.join(NOTEBOOKS, f) for f in os.listdir(NOTEBOOKS) if f.endswith(".ipynb")
    )
    kernel = os.environ.get("ART_KERNEL_BIN", os.path.join(ROOT, "target/debug/art-kernel"))
    prefix = tempfile.mkdtemp(prefix="art-notebooks-")
    started = time.monotonic()
    subprocess.run([kernel, "install", "--prefix", prefix], check=True)
    print(f"kernel installed in {time.monotonic() - started:.0f} s", flush=True)
    os.environ["JUPYTER_PATH"] = os.path.join(prefix, "share", "jupyter")
    # Notebook 3 opens TensorBoard inline: the one installed beside this Python (requirements-test.txt).
    os.environ.setdefault("ART_TENSORBOARD_BIN", os.path.join(os.path.dirname(sys.executable), "tensorboard"))
    for path in paths:
        run(os.path.abspath(path), args.write, args.timeout)
    print(f"{len(paths)} notebooks ran in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()

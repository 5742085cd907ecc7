#!/usr/bin/env python3
"""Compiles the engine's CUDA C kernels to PTX with nvcc, as NVRTC compiles them at run time on
the GPU, so that a mistake in them shows here (no GPU needed) instead of as an error in the
first device run. The kernels live in Rust raw strings (`const SOURCE` in
art-core/src/engine/cuda_*.rs), some starting with the shared prelude (`cuda_prelude!()`).

    eval "$(scripts/cuda-toolkit.sh)"; scripts/check-cuda-kernels.py
"""
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
ENGINE = ROOT / "art-core" / "src" / "engine"
RAW = re.compile(r'r#"(.*?)"#', re.S)


def raw_after(text: str, marker: str) -> str:
    """The first raw string literal after `marker` in `text`."""
    at = text.index(marker)
    return RAW.search(text, at).group(1)


def main() -> int:
    prelude = raw_after((ENGINE / "cuda_decode.rs").read_text(), "macro_rules! cuda_prelude")
    failed = 0
    for path in sorted(ENGINE.glob("cuda_*.rs")):
        text = path.read_text()
        if "const SOURCE" not in text:
            continue
        head = text[text.index("const SOURCE") :][:200]
        source = raw_after(text, "const SOURCE")
        if "cuda_prelude!()" in head:
            source = prelude + source
        with tempfile.TemporaryDirectory() as tmp:
            cu = pathlib.Path(tmp) / f"{path.stem}.cu"
            cu.write_text(source)
            run = subprocess.run(
                ["nvcc", "-arch=compute_90", "--ptx", "-o", str(cu.with_suffix(".ptx")), str(cu)],
                capture_output=True,
                text=True,
            )
        status = "ok" if run.returncode == 0 else "FAILED"
        print(f"{path.relative_to(ROOT)}: {status}")
        if run.returncode != 0:
            failed += 1
            print(run.stdout + run.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

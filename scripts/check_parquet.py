#!/usr/bin/env python3
"""Reads a trajectories parquet written by art-core with pyarrow (independently of polars) and
checks it against an expectation file.

    check_parquet.py FILE.parquet EXPECTED.json

EXPECTED.json: {"rows": N, "types": {column: "int64" | "double" | "bool" | "string" |
"list<string>"}, "values": {column: [v, ...]}, "json_columns": {column: [parsed JSON, ...]}}.
Columns not named are not checked. Exits 1 with every mismatch listed.
"""
import json
import math
import sys

import pyarrow as pa
import pyarrow.parquet as pq


def kind(t: pa.DataType) -> str:
    if pa.types.is_int64(t):
        return "int64"
    if pa.types.is_float64(t):
        return "double"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "string"
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_list_view(t):
        return f"list<{kind(t.value_type)}>"
    return str(t)


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, (int, float)) and not isinstance(b, bool):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12)
    return a == b


def main() -> int:
    path, expected_path = sys.argv[1], sys.argv[2]
    with open(expected_path) as f:
        expected = json.load(f)
    table = pq.read_table(path)
    problems = []
    if table.num_rows != expected["rows"]:
        problems.append(f"rows: {table.num_rows}, expected {expected['rows']}")
    schema = {field.name: kind(field.type) for field in table.schema}
    for column, want in expected.get("types", {}).items():
        got = schema.get(column)
        if got != want:
            problems.append(f"column {column!r}: type {got}, expected {want}")
    for column, want in expected.get("values", {}).items():
        if column not in schema:
            continue  # already reported
        got = table.column(column).to_pylist()
        if len(got) != len(want) or not all(same(g, w) for g, w in zip(got, want)):
            problems.append(f"column {column!r}: {got}, expected {want}")
    for column, want in expected.get("json_columns", {}).items():
        if column not in schema:
            problems.append(f"column {column!r} missing")
            continue
        got = [None if v is None else json.loads(v) for v in table.column(column).to_pylist()]
        if got != want:
            problems.append(f"column {column!r}: {got}, expected {want}")
    if problems:
        print(f"{path}: {len(problems)} problem(s)")
        for p in problems:
            print("  " + p)
        return 1
    print(f"ok: pyarrow {pa.__version__} read {table.num_rows} rows x {table.num_columns} columns")
    return 0


if __name__ == "__main__":
    sys.exit(main())

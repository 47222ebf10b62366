"""`modelfs diff A [B]`: the text rendering of store.diff's record."""

from __future__ import annotations

from typing import Any

from modelfs.cli.human import table
from modelfs.store.tagid import tag_ids
from modelfs.store.units import human_bytes


def _side_line(label: str, side: dict[str, Any]) -> str:
    name = side["name"] or side["ref"]
    shown = tag_ids(
        side["digest"], is_list=side["list"], child=side["manifest"], runner=side["runner"]
    )
    quant = side["file_type"] or "-"
    return (
        f"{label}  {name}  {shown}  ({side['source']})  "
        f"{side['format'] or '-'}  {quant}  {human_bytes(side['size'])}"
    )


def _quant_cell(rows: list[dict[str, Any]] | None, type_: str) -> str:
    if rows is None:
        return "?"
    for row in rows:
        if row["type"] == type_:
            return f"{row['count']} ({human_bytes(row['bytes'])})"
    return "-"


def render(record: dict[str, Any]) -> str:
    a, b = record["a"], record["b"]
    out = [
        _side_line("A", a),
        _side_line("B", b),
        "",
        f"Change: {record['kind']} ({record['reason']})",
    ]
    if record["tensors"]:
        t = record["tensors"]
        out.append(f"Tensors: {t['changed']} of {t['total']} changed")
    out.append("")
    rows = [["BLOBS", "KIND", "SIZE", "DIGEST", "NAME"]]
    for where, label in (("shared", "shared"), ("only_a", "only A"), ("only_b", "only B")):
        for blob in record["blobs"][where]:
            rows.append(
                [
                    label + ("" if blob["present"] else " (absent)"),
                    blob["kind"],
                    human_bytes(blob["size"]),
                    blob["digest"][7:19],
                    blob.get("name", ""),
                ]
            )
    out.append(table(rows))
    sizes = record["bytes"]
    out.append(
        f"shared {human_bytes(sizes['shared'])}, only A {human_bytes(sizes['only_a'])}, "
        f"only B {human_bytes(sizes['only_b'])}"
    )
    types: list[str] = []
    for side in (a, b):
        for row in side["quantization"] or []:
            if row["type"] not in types:
                types.append(row["type"])
    if types:
        rows = [["QUANT", "A", "B"]]
        rows += [
            [t, _quant_cell(a["quantization"], t), _quant_cell(b["quantization"], t)] for t in types
        ]
        out += ["", table(rows)]
    for note in record["notes"]:
        out.append(f"note: {note}")
    return "\n".join(out).rstrip()

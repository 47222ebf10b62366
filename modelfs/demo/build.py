"""`build_demo_store`: every family into one store, with the layers they share."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from modelfs.demo.gemma import build_gemma
from modelfs.demo.ggufspec import GGUFSpec
from modelfs.demo.llama import (
    MIT_LICENSE,
    SMOL_TEMPLATE,
    TINY_SYSTEM,
    TINY_TEMPLATE,
    llama32_gguf,
    smol_gguf,
    tiny_gguf,
)
from modelfs.demo.qwen import qwen3_gguf
from modelfs.demo.records import (
    DAY,
    EPOCH,
    GEMMA,
    GEMMA_MLX,
    LLAMA,
    MEDIA_LICENSE,
    MEDIA_PARAMS,
    MEDIA_SYSTEM,
    MEDIA_TEMPLATE,
    QWEN,
    SMOL,
    TINY,
    DemoLayer,
    DemoStore,
)
from modelfs.demo.writer import Writer, config_v2, params_blob, write_legacy
from modelfs.store.names import parse_name

_CHATML_TEMPLATE = """\
{{- if .System }}<|im_start|>system
{{ .System }}<|im_end|>
{{ end }}
{{- range $i, $_ := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1 -}}
<|im_start|>{{ .Role }}
{{ .Content }}{{ if or (ne .Role "assistant") (not $last) }}<|im_end|>
{{ end }}
{{- if and (ne .Role "assistant") $last }}<|im_start|>assistant
{{ end }}
{{- end }}"""


_APACHE = """\

                                 Apache License
                           Version 2.0, January 2004
                        http://www.apache.org/licenses/

   Licensed under the Apache License, Version 2.0 (the "License"); you may not use
   this model except in compliance with the License. The full text is at the address
   above. (modelfs demo store: an abridged notice, not the full license text.)
"""


def build_demo_store(root: Path, *, weight_bytes: int = 0) -> DemoStore:
    """Write the demo store under `root` (created if needed) and say what was written.

    `weight_bytes` = 0 builds the small store; otherwise the first model's GGUF
    (`gemma4:26b@llamacpp` model.gguf) is about that many bytes, streamed to disk in chunks.
    Building again over the same root rewrites the same bytes.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    w = Writer(root)
    # Newest first: gemma4:26b, qwen3, llama3.2, hf.co/…, someuser/tiny, then gemma4:26b-mlx;
    # the gemma4 anchor is the oldest file of all (the pull the migration started from).
    when = {GEMMA: 5, QWEN: 4, LLAMA: 3, SMOL: 2, TINY: 1}
    mtimes = {key: float(EPOCH + days * DAY) for key, days in when.items()}
    mtimes[GEMMA_MLX] = float(EPOCH + DAY // 2)

    the_list, manifests, anchor, mlx_anchor = build_gemma(
        w, weight_bytes, mtimes[GEMMA], float(EPOCH), mtimes[GEMMA_MLX]
    )

    shared_template = w.bytes(_CHATML_TEMPLATE.encode(), MEDIA_TEMPLATE)
    shared_license = w.bytes(_APACHE.encode(), MEDIA_LICENSE)

    def add(
        key: str,
        spec: GGUFSpec,
        config: Callable[[list[DemoLayer]], dict[str, Any]],
        others: list[DemoLayer],
    ) -> None:
        layers = [w.gguf(spec, key), *others]
        manifests[key] = write_legacy(w, key, w.config(config(layers)), layers, mtimes[key])

    add(
        LLAMA,
        llama32_gguf(),
        lambda ls: config_v2("llama", "3.2B", "Q4_K_M", ls, rootfs=True),
        [
            shared_template,
            shared_license,
            w.bytes(
                params_blob(stop=["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]),
                MEDIA_PARAMS,
            ),
        ],
    )
    add(
        QWEN,
        qwen3_gguf(),
        lambda ls: config_v2("qwen3", "751.63M", "Q8_0", ls, rootfs=True),
        [
            shared_template,
            shared_license,
            w.bytes(
                params_blob(
                    repeat_penalty=1,
                    stop=["<|im_start|>", "<|im_end|>"],
                    temperature=0.6,
                    top_k=20,
                    top_p=0.95,
                ),
                MEDIA_PARAMS,
            ),
        ],
    )
    add(
        SMOL,
        smol_gguf(),
        lambda ls: config_v2("llama", "134.52M", "Q4_K_M", ls, rootfs=True),
        [
            w.bytes(SMOL_TEMPLATE.encode(), MEDIA_TEMPLATE),
            w.bytes(params_blob(stop=["<|im_start|>", "<|im_end|>"]), MEDIA_PARAMS),
        ],
    )
    add(
        TINY,
        tiny_gguf(),
        lambda ls: config_v2("llama", "15.19M", "Q8_0", ls, rootfs=True),
        [
            w.bytes(TINY_TEMPLATE.encode(), MEDIA_TEMPLATE),
            w.bytes(TINY_SYSTEM.encode(), MEDIA_SYSTEM),
            w.bytes(MIT_LICENSE.encode(), MEDIA_LICENSE),
            w.bytes(params_blob(num_ctx=2048, temperature=0.8), MEDIA_PARAMS),
        ],
    )

    names = tuple(sorted(when, key=lambda k: -when[k]))
    model_blob = manifests[f"{GEMMA}@llamacpp"].layer("model.gguf").digest
    return DemoStore(
        root=root,
        names=tuple(parse_name(n).shortest for n in names),
        manifests=manifests,
        lists={GEMMA: the_list},
        anchors={GEMMA: anchor},
        variant_anchors={GEMMA_MLX: mlx_anchor},
        mtimes=mtimes,
        model_blob=model_blob,
        weight_bytes=weight_bytes,
        blobs=frozenset(w.blobs),
    )

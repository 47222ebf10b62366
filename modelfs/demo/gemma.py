"""`gemma4:26b`: a manifest list behind a `manifests-v2` link with a `llamacpp` (GGUF: model,
projector, draft) and an `mlx` (safetensors, `gemma_mlx`) child, plus its legacy anchor."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from modelfs.demo.gemma_mlx import mlx_json_files, mlx_tensors
from modelfs.demo.ggufspec import (
    ALIGN,
    Dims,
    GGUFSpec,
    Q,
    TensorSpec,
    arch_kv,
    general_kv,
    row_bytes,
)
from modelfs.demo.records import (
    GEMMA,
    GEMMA_MLX,
    MEDIA_DRAFT,
    MEDIA_JSON,
    MEDIA_LICENSE,
    MEDIA_PARAMS,
    MEDIA_PROJECTOR,
    MEDIA_TEMPLATE,
    MEDIA_TENSOR,
    DemoLayer,
    DemoList,
    DemoManifest,
)
from modelfs.demo.vocab import GEMMA_JINJA, gemma_vocab
from modelfs.demo.writer import Writer, config_v2, params_blob
from modelfs.store.digest import Digest
from modelfs.store.listtag import write_list_tag
from modelfs.store.manifest import (
    MEDIA_LIST,
    MEDIA_MANIFEST,
    Manifest,
    ManifestList,
    go_marshal,
    parse_manifest,
)
from modelfs.store.names import parse_name
from modelfs.store.scan import DEFAULT_PREFER


def _gemma_tensors(d: Dims, vocab: int) -> list[TensorSpec]:
    e, q, kv = d.embd, d.heads * d.head_dim, d.kv_heads * d.head_dim
    out = [
        TensorSpec("token_embd.weight", Q.Q6_K, (e, vocab)),
        TensorSpec("rope_freqs.weight", Q.F32, (d.head_dim // 2,)),
    ]
    for i in range(d.layers):
        b = f"blk.{i}."
        down = Q.Q6_K if i % 2 == 0 else Q.Q4_K  # Q4_K_M spends more bits on every other layer
        out += [
            TensorSpec(b + "attn_norm.weight", Q.F32, (e,)),
            TensorSpec(b + "attn_q.weight", Q.Q4_K, (e, q)),
            TensorSpec(b + "attn_q_norm.weight", Q.F32, (d.head_dim,)),
            TensorSpec(b + "attn_k.weight", Q.Q4_K, (e, kv)),
            TensorSpec(b + "attn_k_norm.weight", Q.F32, (d.head_dim,)),
            TensorSpec(b + "attn_v.weight", Q.Q6_K, (e, kv)),
            TensorSpec(b + "attn_output.weight", Q.Q4_K, (q, e)),
            TensorSpec(b + "post_attention_norm.weight", Q.F32, (e,)),
            TensorSpec(b + "ffn_norm.weight", Q.F32, (e,)),
            TensorSpec(b + "ffn_gate.weight", Q.Q4_K, (e, d.ff)),
            TensorSpec(b + "ffn_up.weight", Q.Q4_K, (e, d.ff)),
            TensorSpec(b + "ffn_down.weight", down, (d.ff, e)),
        ]
        if d.experts:  # the dense FFN above is the shared expert
            out += [
                TensorSpec(b + "post_ffw_norm_1.weight", Q.F32, (e,)),
                TensorSpec(b + "ffn_gate_inp.weight", Q.F32, (e, d.experts)),
                TensorSpec(b + "ffn_gate_inp.scale", Q.F32, (e,)),
                TensorSpec(b + "pre_ffw_norm_2.weight", Q.F32, (e,)),
                TensorSpec(b + "ffn_gate_up_exps.weight", Q.Q4_K, (e, 2 * d.ff_exp, d.experts)),
                TensorSpec(b + "ffn_down_exps.weight", down, (d.ff_exp, e, d.experts)),
                TensorSpec(b + "ffn_down_exps.scale", Q.F32, (d.experts,)),
                TensorSpec(b + "post_ffw_norm_2.weight", Q.F32, (e,)),
            ]
        out += [
            TensorSpec(b + "post_ffw_norm.weight", Q.F32, (e,)),
            TensorSpec(b + "layer_output_scale.weight", Q.F32, (1,)),
        ]
    out.append(TensorSpec("output_norm.weight", Q.F32, (e,)))
    return out


_GEMMA_SMALL = Dims(
    embd=256, layers=2, heads=4, kv_heads=2, head_dim=64, ff=256, experts=4, ff_exp=256
)


def _gemma_dims(weight_bytes: int) -> tuple[Dims, int]:
    """Shapes and vocabulary size that make the gemma4 GGUF's tensor data ~weight_bytes.

    Width and depth grow in steps with the target; the expert FFN width (a multiple of 256,
    as K-quants need) takes most of the bytes, and the vocabulary (rows of token_embd, each
    a few KiB) makes up the rest.
    """
    base_vocab = len(gemma_vocab(0).tokens)
    if weight_bytes <= 0:
        return _GEMMA_SMALL, base_vocab
    if weight_bytes < 256 << 20:
        embd, layers = 512, 4
    elif weight_bytes < 2 << 30:
        embd, layers = 1024, 8
    else:
        embd, layers = 2048, 12
    dims = Dims(
        embd=embd,
        layers=layers,
        heads=embd // 128,
        kv_heads=embd // 256,
        head_dim=128,
        ff=2 * embd,
        experts=8,
        ff_exp=256,
    )

    def data_bytes(d: Dims, vocab: int) -> int:
        return sum(t.nbytes + (-t.nbytes % ALIGN) for t in _gemma_tensors(d, vocab))

    per_step = data_bytes(dataclasses.replace(dims, ff_exp=512), base_vocab) - data_bytes(
        dims, base_vocab
    )
    steps = max(0, (weight_bytes - data_bytes(dims, base_vocab)) // per_step)
    dims = dataclasses.replace(dims, ff_exp=256 * (1 + steps))
    row = row_bytes(Q.Q6_K, embd)
    extra = max(0, weight_bytes - data_bytes(dims, base_vocab)) // row
    return dataclasses.replace(dims, unused_tokens=extra), base_vocab + extra


def _gemma_attention_kv(d: Dims) -> dict[str, Any]:
    """Sliding-window layers, five of every six, and always a global last layer."""
    pattern = [i % 6 != 5 and i != d.layers - 1 for i in range(d.layers)]
    return {
        "attention.layer_norm_rms_epsilon": 1e-6,
        "attention.sliding_window": 1024,
        "attention.sliding_window_pattern": pattern,
        "attention.key_length_swa": d.head_dim,
        "attention.value_length_swa": d.head_dim,
        "embedding_length_per_layer_input": 0,
        "rope.freq_base": 1_000_000.0,
        "rope.freq_base_swa": 10_000.0,
    }


def _gemma_gguf(weight_bytes: int) -> GGUFSpec:
    dims, vocab_size = _gemma_dims(weight_bytes)
    vocab = gemma_vocab(dims.unused_tokens)
    assert len(vocab.tokens) == vocab_size
    kv = general_kv(
        "gemma4",
        "Gemma 4 26B A4B It",
        params=25_805_933_056,
        file_type=15,
        basename="gemma-4",
        size_label="26B-A4B",
        license="gemma",
    )
    kv.update(
        arch_kv(
            "gemma4",
            dims,
            262_144,
            {
                "expert_count": dims.experts,
                "expert_used_count": 2,
                "expert_feed_forward_length": dims.ff_exp,
                "final_logit_softcapping": 30.0,
                **_gemma_attention_kv(dims),
            },
        )
    )
    kv.update(vocab.kv(None, bos="<bos>", eos="<eos>", add_bos=True, pad="<pad>", unk="<unk>"))
    kv["tokenizer.chat_template"] = GEMMA_JINJA
    return GGUFSpec("gemma4", kv, _gemma_tensors(dims, vocab_size))


def _gemma_projector() -> GGUFSpec:
    kv = general_kv(
        "clip",
        "Gemma 4 26B A4B It",
        params=416_866_032,
        file_type=1,
        basename="gemma-4",
        size_label="26B-A4B",
        kind="mmproj",
    )
    width, ff, layers = 128, 256, 1
    kv.update(
        {
            "clip.has_vision_encoder": True,
            "clip.projector_type": "gemma4v",
            "clip.use_gelu": True,
            "clip.vision.image_size": 896,
            "clip.vision.patch_size": 14,
            "clip.vision.embedding_length": width,
            "clip.vision.feed_forward_length": ff,
            "clip.vision.projection_dim": 256,
            "clip.vision.block_count": layers,
            "clip.vision.attention.head_count": 2,
            "clip.vision.attention.layer_norm_epsilon": 1e-6,
            "clip.vision.image_mean": [0.5, 0.5, 0.5],
            "clip.vision.image_std": [0.5, 0.5, 0.5],
        }
    )
    tensors = [
        TensorSpec("v.patch_embd.weight", Q.F16, (14, 14, 3, width)),
        TensorSpec("v.patch_embd.bias", Q.F32, (width,)),
        TensorSpec("v.position_embd.weight", Q.F16, (width, 64)),
    ]
    for i in range(layers):
        b = f"v.blk.{i}."
        for part in ("attn_q", "attn_k", "attn_v", "attn_out"):
            tensors.append(TensorSpec(b + part + ".weight", Q.F16, (width, width)))
            tensors.append(TensorSpec(b + part + ".bias", Q.F32, (width,)))
        tensors += [
            TensorSpec(b + "ln1.weight", Q.F32, (width,)),
            TensorSpec(b + "ffn_up.weight", Q.F16, (width, ff)),
            TensorSpec(b + "ffn_down.weight", Q.F16, (ff, width)),
            TensorSpec(b + "ln2.weight", Q.F32, (width,)),
        ]
    tensors += [
        TensorSpec("v.post_ln.weight", Q.F32, (width,)),
        TensorSpec("mm.input_projection.weight", Q.F16, (width, 256)),
        TensorSpec("mm.soft_emb_norm.weight", Q.F32, (width,)),
    ]
    return GGUFSpec("clip", kv, tensors)


def _gemma_draft() -> GGUFSpec:
    dims = Dims(embd=256, layers=2, heads=4, kv_heads=1, head_dim=64, ff=256)
    vocab = gemma_vocab(0)
    kv = general_kv(
        "gemma4",
        "Gemma 4 26B A4B Assistant",
        params=74_000_000,
        file_type=7,
        basename="gemma-4-assistant",
        size_label="74M",
    )
    kv.update(arch_kv("gemma4", dims, 262_144, _gemma_attention_kv(dims)))
    kv.update(vocab.kv(None, bos="<bos>", eos="<eos>", add_bos=True, pad="<pad>", unk="<unk>"))
    tensors = [
        TensorSpec(t.name, t.qtype if t.qtype == Q.F32 else Q.Q8_0, t.ne)
        for t in _gemma_tensors(dims, len(vocab.tokens))
    ]
    return GGUFSpec("gemma4", kv, tensors)


_GEMMA_TEMPLATE = """\
{{- range $i, $_ := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1 }}
{{- if or (eq .Role "user") (eq .Role "system") }}<start_of_turn>user
{{ .Content }}<end_of_turn>
{{ if $last }}<start_of_turn>model
{{ end }}
{{- else if eq .Role "assistant" }}<start_of_turn>model
{{ .Content }}{{ if not $last }}<end_of_turn>
{{ end }}
{{- end }}
{{- end }}"""


_GEMMA_LICENSE = """\
Gemma Terms of Use

This model is provided under the Gemma Terms of Use, found at ai.google.dev/gemma/terms.
(modelfs demo store: an abridged notice, not the full terms.)
"""


def _parsed(raw: bytes) -> Manifest:
    m = parse_manifest(raw, GEMMA)
    assert isinstance(m, Manifest)
    return m


def build_gemma(
    w: Writer, weight_bytes: int, mtime: float, anchor_mtime: float, variant_mtime: float
) -> tuple[DemoList, dict[str, DemoManifest], DemoManifest, DemoManifest]:
    """gemma4:26b's blobs, list and tag (`store.listtag.write_list_tag`); returns the list,
    its children by `name@runner`, the legacy anchor and the mlx child's legacy file."""
    name = parse_name(GEMMA)
    template = w.bytes(_GEMMA_TEMPLATE.encode(), MEDIA_TEMPLATE)
    license_ = w.bytes(_GEMMA_LICENSE.encode(), MEDIA_LICENSE)
    params = w.bytes(
        params_blob(stop=["<end_of_turn>"], temperature=1, top_k=64, top_p=0.95), MEDIA_PARAMS
    )
    capabilities = ["completion", "vision", "tools", "thinking"]

    # llamacpp / gguf
    gguf_layers = [
        w.gguf(_gemma_gguf(weight_bytes), "gemma4-26b"),
        w.gguf(_gemma_projector(), "gemma4-26b-mmproj", MEDIA_PROJECTOR),
        w.gguf(_gemma_draft(), "gemma4-26b-draft", MEDIA_DRAFT),
        template,
        license_,
        params,
    ]
    gguf_config = w.config(
        config_v2(
            "gemma4",
            "25.8B",
            "Q4_K_M",
            gguf_layers,
            rootfs=False,
            renderer="gemma4",
            parser="gemma4",
            requires="0.20.0",
            capabilities=capabilities,
        )
    )
    gguf_raw = w.manifest_bytes(
        gguf_config, gguf_layers, runner="llamacpp", fmt="gguf", newline=False
    )
    gguf_digest = w.bytes(gguf_raw, MEDIA_MANIFEST).digest

    # mlx / safetensors
    mlx_layers = [w.bytes(data, MEDIA_TENSOR, tname) for tname, data in mlx_tensors()]
    mlx_layers += [w.bytes(data, MEDIA_JSON, fname) for fname, data in mlx_json_files()]
    mlx_layers += [template, license_, params]
    mlx_config = w.config(
        {
            "model_format": "safetensors",
            "model_family": "gemma4",
            "model_families": ["gemma4"],
            "model_type": "25.8B",
            "file_type": "nvfp4",
            "renderer": "gemma4",
            "parser": "gemma4",
            "requires": "0.19.0",
            "capabilities": capabilities,
            "draft": {
                "model_format": "safetensors",
                "architecture": "Gemma4AssistantForCausalLM",
                "tensor_prefix": "draft.",
                "config": "draft/config.json",
            },
            "architecture": "",
            "os": "",
        }
    )
    mlx_raw = w.manifest_bytes(
        mlx_config, mlx_layers, runner="mlx", fmt="safetensors", newline=False
    )
    mlx_digest = w.bytes(mlx_raw, MEDIA_MANIFEST).digest

    children = (("llamacpp", "gguf", gguf_digest), ("mlx", "safetensors", mlx_digest))
    list_raw = go_marshal(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_LIST,
            "manifests": [
                {"mediaType": MEDIA_MANIFEST, "digest": str(d), "runner": r, "format": f}
                for r, f, d in children
            ],
        }
    )
    # The tag as every writer of a list leaves it (store.listtag): the v2 link, the legacy
    # anchor (the llamacpp child plus references to the list and child manifest blobs) and
    # `26b-mlx` (the mlx child), so that a stock Ollama's prune keeps every blob shown.
    lst = parse_manifest(list_raw, GEMMA)
    assert isinstance(lst, ManifestList)
    present = [(i, _parsed(raw)) for i, raw in enumerate((gguf_raw, mlx_raw))]
    link, anchor_path, mlx_path = write_list_tag(
        w.store, name, list_raw, lst, present, DEFAULT_PREFER
    )
    list_digest = Digest.of_bytes(list_raw)
    w.blobs.add(list_digest)
    os.utime(link, (mtime, mtime), follow_symlinks=False)
    os.utime(anchor_path, (anchor_mtime, anchor_mtime))
    os.utime(mlx_path, (variant_mtime, variant_mtime))
    the_list = DemoList(name, list_digest, list_raw, link, children, mtime)

    variants = {
        f"{GEMMA}@llamacpp": DemoManifest(
            f"{GEMMA}@llamacpp",
            name,
            "llamacpp",
            "gguf",
            gguf_digest,
            gguf_raw,
            None,
            gguf_config,
            tuple(gguf_layers),
        ),
        f"{GEMMA}@mlx": DemoManifest(
            f"{GEMMA}@mlx",
            name,
            "mlx",
            "safetensors",
            mlx_digest,
            mlx_raw,
            None,
            mlx_config,
            tuple(mlx_layers),
        ),
    }

    anchor_raw = anchor_path.read_bytes()
    anchor_layers = (
        *gguf_layers,
        DemoLayer(MEDIA_LIST, list_digest, len(list_raw)),
        DemoLayer(MEDIA_MANIFEST, gguf_digest, len(gguf_raw)),
        DemoLayer(MEDIA_MANIFEST, mlx_digest, len(mlx_raw)),
    )
    anchor = DemoManifest(
        GEMMA,
        name,
        "llamacpp",
        "gguf",
        Digest.of_bytes(anchor_raw),
        anchor_raw,
        anchor_path,
        gguf_config,
        anchor_layers,
        anchor_mtime,
    )
    mlx_anchor = dataclasses.replace(
        variants[f"{GEMMA}@mlx"],
        key=GEMMA_MLX,
        name=parse_name(GEMMA_MLX),
        path=mlx_path,
        mtime=variant_mtime,
    )
    return the_list, variants, anchor, mlx_anchor

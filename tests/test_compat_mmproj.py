"""llama.cpp clip (mmproj.gguf) views of Ollama's monolithic vision models: per handler, a small
GGUF in the Ollama layout built here, its view read back with the reference reader
(`gguf.GGUFReader`), checked against what Ollama's upstream handler (ollama/ollama
llama/compat/llama-ollama-compat.cpp) leaves in memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from modelfs.store.compat.compute import ComputeCache  # noqa: E402
from tests.compat_gguf import (  # noqa: E402
    CLIP_MEAN,
    CLIP_STD,
    KV,
    Tensor,
    V,
    check_aligned,
    check_renamed,
    f16,
    f32,
    field_type,
    fields,
    materialize,
    raw,
    tensors,
    tokenizer,
    views_of,
    write_gguf,
)

# -- clip (mmproj.gguf) views of the other monolithic architectures -----------------------


def mmproj_of(src: Path, tmp_path: Path) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """(view reader, its KVs, the source's tensors by name) of src's mmproj view."""
    views = views_of(src)
    assert views.mmproj is not None
    reader = gguf.GGUFReader(materialize(views.mmproj, tmp_path, ComputeCache(None)))
    check_aligned(reader)
    kv = fields(reader)
    assert kv["general.architecture"] == "clip"
    assert not any(k.startswith("tokenizer.") for k in kv)
    return reader, kv, tensors(gguf.GGUFReader(src))


def as_f32(t: Any) -> np.ndarray:
    assert t.tensor_type == gguf.GGMLQuantizationType.F32
    return np.asarray(t.data, np.float32)


def qwen35_vision(tmp_path: Path, arch: str) -> Path:
    """qwen35(moe) with its vision tower inline: separate q/k/v, a packed two-frame F16
    patch embedding, the merger under v.merger.*."""
    kvs: list[KV] = [
        (f"{arch}.block_count", 1, V.UINT32),
        (f"{arch}.embedding_length", 64, V.UINT32),
        (f"{arch}.vision.block_count", 2, V.UINT32),
        (f"{arch}.vision.embedding_length", 8, V.UINT32),
        (f"{arch}.vision.attention.head_count", 2, V.UINT32),
        (f"{arch}.vision.patch_size", 2, V.UINT32),
        (f"{arch}.vision.spatial_merge_size", 2, V.UINT32),
        (f"{arch}.vision.num_channels", 3, V.UINT32),
        *tokenizer(16, model="gpt2"),
    ]
    ts: list[Tensor] = [("token_embd.weight", (16, 64), "Q8_0"), ("mtp.fc.weight", f32(64, 4))]
    for b in range(2):
        for i, x in enumerate("qkv"):
            ts.append((f"v.blk.{b}.attn_{x}.weight", f16(8, 8, seed=10 * b + i)))
            ts.append((f"v.blk.{b}.attn_{x}.bias", f32(8, seed=20 + 10 * b + i)))
        ts += [
            (f"v.blk.{b}.attn_out.weight", f16(8, 8, seed=40 + b)),
            (f"v.blk.{b}.norm1.weight", f32(8, seed=42 + b)),
            (f"v.blk.{b}.norm2.weight", f32(8, seed=44 + b)),
            (f"v.blk.{b}.mlp.linear_fc1.weight", f16(16, 8, seed=46 + b)),
            (f"v.blk.{b}.mlp.linear_fc2.weight", f16(8, 16, seed=48 + b)),
        ]
    ts += [
        # numpy order [c_out*c_in, frames, h, w] = ggml [w, h, frames, packed]
        ("v.patch_embed.weight", f16(8 * 3, 2, 2, 2, seed=50)),
        ("v.pos_embed.weight", f16(4, 8, seed=51)),
        ("v.merger.norm.weight", f32(8, seed=52)),
        ("v.merger.linear_fc1.weight", f16(32, 32, seed=53)),
        ("v.merger.linear_fc2.weight", f16(64, 32, seed=54)),
    ]
    return write_gguf(tmp_path / f"{arch}-vision.gguf", arch, kvs, ts)


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_qwen35_mmproj_view(tmp_path: Path, arch: str) -> None:
    src = qwen35_vision(tmp_path, arch)
    assert views_of(src).mmproj.handler == f"handle_{arch}_clip"  # type: ignore[union-attr]
    reader, kv, source = mmproj_of(src, tmp_path)
    assert kv["clip.projector_type"] == "qwen3vl_merger"
    assert kv["clip.vision.block_count"] == 2
    assert kv["clip.vision.embedding_length"] == 8
    assert kv["clip.vision.attention.head_count"] == 2
    assert kv["clip.vision.patch_size"] == 2
    assert kv["clip.vision.spatial_merge_size"] == 2
    assert kv["clip.vision.num_channels"] == 3
    assert kv["clip.vision.projection_dim"] == 64
    # Defaults of the reference mmproj for what these files lack.
    assert kv["clip.vision.feed_forward_length"] == 4304
    assert kv["clip.vision.image_size"] == 768
    assert kv["clip.vision.attention.layer_norm_epsilon"] == pytest.approx(1e-6)
    assert kv["clip.vision.image_mean"] == [0.5] * 3 and kv["clip.vision.image_std"] == [0.5] * 3
    assert kv["clip.vision.is_deepstack_layers"] == [False, False]
    assert field_type(reader, "clip.vision.is_deepstack_layers") == [V.ARRAY, V.BOOL]
    assert kv["clip.has_vision_encoder"] is True and kv["clip.use_gelu"] is True
    got = tensors(reader)
    for b in range(2):
        # q, k, v concatenated along the slow axis: [8, 8] x 3 -> [8, 24].
        w, bias = got[f"v.blk.{b}.attn_qkv.weight"], got[f"v.blk.{b}.attn_qkv.bias"]
        assert list(w.shape) == [8, 24] and list(bias.shape) == [24]
        assert w.tensor_type == gguf.GGMLQuantizationType.F16
        parts = [source[f"v.blk.{b}.attn_{x}.weight"] for x in "qkv"]
        assert raw(w) == b"".join(raw(p) for p in parts)
        bparts = [source[f"v.blk.{b}.attn_{x}.bias"] for x in "qkv"]
        assert raw(bias) == b"".join(raw(p) for p in bparts)
        for x in "qkv":
            assert f"v.blk.{b}.attn_{x}.weight" not in got  # merged: no orphans
    check_renamed(
        got,
        source,
        {
            "v.blk.0.ln1.weight": "v.blk.0.norm1.weight",
            "v.blk.1.ln2.weight": "v.blk.1.norm2.weight",
            "v.blk.0.ffn_up.weight": "v.blk.0.mlp.linear_fc1.weight",
            "v.blk.1.ffn_down.weight": "v.blk.1.mlp.linear_fc2.weight",
            "v.blk.0.attn_out.weight": "v.blk.0.attn_out.weight",
            "v.post_ln.weight": "v.merger.norm.weight",
            "mm.0.weight": "v.merger.linear_fc1.weight",
            "mm.2.weight": "v.merger.linear_fc2.weight",
        },
    )
    # The packed two-frame patch embedding -> one F32 [w, h, c_in, c_out] per frame.
    packed = np.asarray(source["v.patch_embed.weight"].data).reshape(24, 2, 2, 2)
    for name, frame in (("v.patch_embd.weight", 0), ("v.patch_embd.weight.1", 1)):
        assert list(got[name].shape) == [2, 2, 3, 8]
        want = packed[:, frame].astype(np.float32).reshape(8, 3, 2, 2)
        assert np.array_equal(as_f32(got[name]).reshape(8, 3, 2, 2), want)
    pos = got["v.position_embd.weight"]
    assert np.array_equal(as_f32(pos), np.asarray(source["v.pos_embed.weight"].data, np.float32))
    assert not any(n.startswith(("token_embd", "mtp.", "blk.")) for n in got)
    assert len(got) == 2 * 7 + 6  # per block 7; two patch slices, pos, post_ln, mm.0, mm.2


def test_mistral3_mmproj_view(tmp_path: Path) -> None:
    kvs: list[KV] = [
        ("mistral3.block_count", 1, V.UINT32),
        ("mistral3.embedding_length", 64, V.UINT32),
        ("mistral3.spatial_merge_size", 2, V.UINT32),
        ("mistral3.vision.block_count", 1, V.UINT32),
        ("mistral3.vision.embedding_length", 16, V.UINT32),
        ("mistral3.vision.feed_forward_length", 32, V.UINT32),
        ("mistral3.vision.attention.head_count", 2, V.UINT32),
        ("mistral3.vision.image_size", 32, V.UINT32),
        ("mistral3.vision.patch_size", 4, V.UINT32),
        ("mistral3.vision.num_channels", 3, V.UINT32),
        ("mistral3.vision.rope.freq_base", 10000.0, V.FLOAT32),
        *tokenizer(16, model="gpt2"),
    ]
    ts: list[Tensor] = [
        ("token_embd.weight", (16, 64), "Q8_0"),
        ("output_norm.weight", f32(64, seed=1)),
        ("v.patch_conv.weight", f16(16, 3, 4, 4, seed=2)),
        ("v.encoder_norm.weight", f32(16, seed=3)),
        ("v.blk.0.attn_q.weight", f16(16, 16, seed=4)),
        ("v.blk.0.attn_k.weight", f16(16, 16, seed=5)),
        ("v.blk.0.attn_v.weight", f16(16, 16, seed=6)),
        ("v.blk.0.attn_output.weight", f16(16, 16, seed=7)),
        ("v.blk.0.attn_norm.weight", f32(16, seed=8)),
        ("v.blk.0.ffn_norm.weight", f32(16, seed=9)),
        ("mm.linear_1.weight", f16(64, 16, seed=10)),
        ("mm.linear_2.weight", f16(64, 64, seed=11)),
        ("mm.norm.weight", f32(16, seed=12)),
        ("mm.patch_merger.merging_layer.weight", f16(16, 64, seed=13)),
    ]
    src = write_gguf(tmp_path / "mistral3-vision.gguf", "mistral3", kvs, ts)
    reader, kv, source = mmproj_of(src, tmp_path)
    assert kv["clip.projector_type"] == "pixtral"
    for key, want in (
        ("block_count", 1),
        ("embedding_length", 16),
        ("feed_forward_length", 32),
        ("attention.head_count", 2),
        ("image_size", 32),
        ("patch_size", 4),
        ("num_channels", 3),
        ("spatial_merge_size", 2),
        ("projection_dim", 64),
    ):
        assert kv[f"clip.vision.{key}"] == want, key
    assert kv["clip.rope.freq_base"] == pytest.approx(10000.0)
    assert kv["clip.vision.attention.layer_norm_epsilon"] == pytest.approx(1e-5)
    assert kv["clip.vision.image_mean"] == pytest.approx([0.48145467, 0.4578275, 0.40821072])
    assert kv["clip.vision.image_std"] == pytest.approx([0.26862955, 0.26130259, 0.2757771])
    assert kv["clip.has_vision_encoder"] is True and kv["clip.use_silu"] is True
    got = tensors(reader)
    # Vision Q/K rows in llama.cpp's RoPE order: per head, [n_head, 2, hd/2] -> [n_head,
    # hd/2, 2] (what llama.cpp's converter does); V untouched.
    for x in "qk":
        w = np.asarray(source[f"v.blk.0.attn_{x}.weight"].data)
        want = w.reshape(2, 2, 4, 16).swapaxes(1, 2).reshape(16, 16)
        t = got[f"v.blk.0.attn_{x}.weight"]
        assert t.tensor_type == gguf.GGMLQuantizationType.F16
        assert np.array_equal(np.asarray(t.data), want)
    # [IMG_BREAK]'s embedding: zeros, F32 [n_embd], in output_norm's place.
    brk = got["v.token_embd.img_break"]
    assert list(brk.shape) == [64] and not as_f32(brk).any()
    patch = got["v.patch_embd.weight"]
    assert list(patch.shape) == list(source["v.patch_conv.weight"].shape)
    assert np.array_equal(as_f32(patch), np.asarray(source["v.patch_conv.weight"].data, np.float32))
    check_renamed(
        got,
        source,
        {
            "v.pre_ln.weight": "v.encoder_norm.weight",
            "v.blk.0.attn_v.weight": "v.blk.0.attn_v.weight",
            "v.blk.0.attn_out.weight": "v.blk.0.attn_output.weight",
            "v.blk.0.ln1.weight": "v.blk.0.attn_norm.weight",
            "v.blk.0.ln2.weight": "v.blk.0.ffn_norm.weight",
            "mm.1.weight": "mm.linear_1.weight",
            "mm.2.weight": "mm.linear_2.weight",
            "mm.input_norm.weight": "mm.norm.weight",
            "mm.patch_merger.weight": "mm.patch_merger.merging_layer.weight",
        },
    )
    assert len(got) == 13


def test_llama4_mmproj_view(tmp_path: Path) -> None:
    kvs: list[KV] = [
        ("llama4.block_count", 1, V.UINT32),
        ("llama4.embedding_length", 64, V.UINT32),
        ("llama4.vision.block_count", 1, V.UINT32),
        ("llama4.vision.embedding_length", 16, V.UINT32),
        ("llama4.vision.feed_forward_length", 32, V.UINT32),
        ("llama4.vision.attention.head_count", 2, V.UINT32),
        ("llama4.vision.image_size", 28, V.UINT32),
        ("llama4.vision.patch_size", 14, V.UINT32),
        ("llama4.vision.layer_norm_epsilon", 1e-5, V.FLOAT32),
        ("llama4.vision.pixel_shuffle_ratio", 0.5, V.FLOAT32),
        *tokenizer(16, model="gpt2"),
    ]
    renames = {
        "v.position_embd.weight": "v.positional_embedding_vlm",
        "v.patch_embd.weight": "v.patch_embedding.weight",
        "v.class_embd": "v.class_embedding",
        "v.pre_ln.weight": "v.layernorm_pre.weight",
        "v.post_ln.weight": "v.layernorm_post.weight",
        "v.blk.0.attn_q.weight": "v.blk.0.attn_q.weight",
        "v.blk.0.attn_out.weight": "v.blk.0.attn_output.weight",
        "v.blk.0.ln1.weight": "v.blk.0.attn_norm.weight",
        "v.blk.0.ln2.weight": "v.blk.0.ffn_norm.weight",
        "v.blk.0.ffn_up.weight": "v.blk.0.mlp.fc1.weight",
        "v.blk.0.ffn_down.weight": "v.blk.0.mlp.fc2.weight",
        "mm.model.mlp.1.weight": "v.vision_adapter.mlp.fc1.weight",
        "mm.model.mlp.2.weight": "v.vision_adapter.mlp.fc2.weight",
        "mm.model.fc.weight": "mm.linear_1.weight",
    }
    ts: list[Tensor] = [("token_embd.weight", (16, 64), "Q8_0")]
    ts += [(old, f16(4, 16, seed=i)) for i, old in enumerate(renames.values())]
    src = write_gguf(tmp_path / "llama4-vision.gguf", "llama4", kvs, ts)
    reader, kv, source = mmproj_of(src, tmp_path)
    assert kv["clip.projector_type"] == "llama4"
    assert kv["clip.vision.projector_type"] == "llama4"
    assert kv["clip.vision.block_count"] == 1 and kv["clip.vision.embedding_length"] == 16
    assert kv["clip.vision.feed_forward_length"] == 32
    assert kv["clip.vision.attention.head_count"] == 2
    assert kv["clip.vision.image_size"] == 28 and kv["clip.vision.patch_size"] == 14
    assert kv["clip.vision.attention.layer_norm_epsilon"] == pytest.approx(1e-5)
    assert kv["clip.vision.projection_dim"] == 64
    assert kv["clip.vision.projector.scale_factor"] == 2  # 1 / pixel_shuffle_ratio
    assert kv["clip.has_vision_encoder"] is True and kv["clip.use_gelu"] is True
    got = tensors(reader)
    assert sorted(got) == sorted(renames)
    check_renamed(got, source, renames)


def gemma4_multimodal(tmp_path: Path) -> Path:
    """gemma4 with its vision and audio encoders inline (Ollama's layout)."""
    kvs: list[KV] = [
        ("gemma4.block_count", 1, V.UINT32),
        ("gemma4.embedding_length", 64, V.UINT32),
        ("gemma4.vision.block_count", 1, V.UINT32),
        ("gemma4.vision.embedding_length", 16, V.UINT32),
        ("gemma4.vision.feed_forward_length", 32, V.UINT32),
        ("gemma4.vision.attention.head_count", 2, V.UINT32),
        ("gemma4.vision.attention.layer_norm_epsilon", 1e-6, V.FLOAT32),
        ("gemma4.vision.patch_size", 16, V.UINT32),
        ("gemma4.audio.block_count", 2, V.UINT32),
        ("gemma4.audio.embedding_length", 24, V.UINT32),
        ("gemma4.audio.feed_forward_length", 48, V.UINT32),
        ("gemma4.audio.attention.head_count", 4, V.UINT32),
        ("gemma4.audio.attention.layer_norm_epsilon", 1e-5, V.FLOAT32),
        *tokenizer(16, model="llama"),
    ]
    ts: list[Tensor] = [
        ("token_embd.weight", (16, 64), "Q8_0"),
        ("v.patch_embd.weight", f16(16, 3, 4, 4, seed=1)),
        ("v.blk.0.attn_q.weight", f16(16, 16, seed=2)),
        ("v.blk.0.ln1.weight", f32(16, seed=3)),
        ("mm.input_projection.weight", f16(64, 16, seed=4)),
        ("a.pre_encode.out.weight", f16(24, 32, seed=5)),
        ("mm.a.fc.weight", f16(24, 24, seed=6)),
        ("mm.a.fc.bias", f32(24, seed=7)),
        ("mm.a.input_projection.weight", f16(64, 24, seed=8)),
        ("model.vision_tower.extra.weight", f32(4, seed=9)),
    ]
    for b in range(2):
        for i, leaf in enumerate(("ln1", "ln2", "layer_pre_norm", "linear_pos", "attn_q")):
            ts.append((f"a.blk.{b}.{leaf}.weight", f32(24, seed=10 + 10 * b + i)))
    return write_gguf(tmp_path / "gemma4-mm.gguf", "gemma4", kvs, ts)


def test_gemma4_mmproj_view(tmp_path: Path) -> None:
    src = gemma4_multimodal(tmp_path)
    views = views_of(src)
    assert views.mmproj is not None and views.mmproj.handler == "handle_gemma4_clip"
    reader, kv, source = mmproj_of(src, tmp_path)
    assert kv["clip.vision.projector_type"] == "gemma4v"
    assert kv["clip.audio.projector_type"] == "gemma4a"
    assert "clip.projector_type" not in kv
    assert kv["clip.vision.block_count"] == 1 and kv["clip.vision.embedding_length"] == 16
    assert kv["clip.vision.feed_forward_length"] == 32
    assert kv["clip.vision.attention.head_count"] == 2
    assert kv["clip.vision.attention.layer_norm_epsilon"] == pytest.approx(1e-6)
    assert kv["clip.vision.patch_size"] == 16
    assert kv["clip.vision.image_size"] == 224
    assert kv["clip.vision.projection_dim"] == 64
    assert kv["clip.vision.image_mean"] == [0.0] * 3 and kv["clip.vision.image_std"] == [1.0] * 3
    assert kv["clip.has_vision_encoder"] is True
    assert kv["clip.audio.block_count"] == 2 and kv["clip.audio.embedding_length"] == 24
    assert kv["clip.audio.feed_forward_length"] == 48
    assert kv["clip.audio.attention.head_count"] == 4
    assert kv["clip.audio.attention.layer_norm_epsilon"] == pytest.approx(1e-5)
    assert kv["clip.audio.num_mel_bins"] == 128
    assert kv["clip.audio.projection_dim"] == 64
    assert kv["clip.has_audio_encoder"] is True
    got = tensors(reader)
    patch = got["v.patch_embd.weight"]
    assert np.array_equal(as_f32(patch), np.asarray(source["v.patch_embd.weight"].data, np.float32))
    renames = {
        "v.blk.0.attn_q.weight": "v.blk.0.attn_q.weight",
        "v.blk.0.ln1.weight": "v.blk.0.ln1.weight",  # vision blocks keep ln1/ln2
        "mm.input_projection.weight": "mm.input_projection.weight",
        "a.input_projection.weight": "a.pre_encode.out.weight",
        "a.pre_encode.out.weight": "mm.a.fc.weight",
        "a.pre_encode.out.bias": "mm.a.fc.bias",
        "mm.a.input_projection.weight": "mm.a.input_projection.weight",
    }
    for b in range(2):
        renames |= {
            f"a.blk.{b}.attn_pre_norm.weight": f"a.blk.{b}.ln1.weight",
            f"a.blk.{b}.attn_post_norm.weight": f"a.blk.{b}.ln2.weight",
            f"a.blk.{b}.ln2.weight": f"a.blk.{b}.layer_pre_norm.weight",
            f"a.blk.{b}.attn_k_rel.weight": f"a.blk.{b}.linear_pos.weight",
            f"a.blk.{b}.attn_q.weight": f"a.blk.{b}.attn_q.weight",
        }
    check_renamed(got, source, renames)
    assert sorted(got) == sorted([*renames, "v.patch_embd.weight"])  # no text, no extras


def check_patch_pair(got: dict[str, Any], source: dict[str, Any]) -> None:
    """v.patch_embd_0/_1 (one per frame, F16) -> v.patch_embd.weight and .weight.1 in F32."""
    for name, old in (("v.patch_embd.weight", "_0"), ("v.patch_embd.weight.1", "_1")):
        src = source[f"v.patch_embd{old}.weight"]
        assert list(got[name].shape) == list(src.shape)
        assert np.array_equal(as_f32(got[name]), np.asarray(src.data, np.float32))


def test_qwen25vl_mmproj_view(tmp_path: Path) -> None:
    kvs: list[KV] = [
        ("qwen25vl.block_count", 1, V.UINT32),
        ("qwen25vl.embedding_length", 64, V.UINT32),
        ("qwen25vl.rope.mrope_section", [16, 24, 24], V.ARRAY, V.INT32),
        ("qwen25vl.vision.block_count", 1, V.UINT32),
        ("qwen25vl.vision.embedding_length", 8, V.UINT32),
        ("qwen25vl.vision.attention.head_count", 2, V.UINT32),
        ("qwen25vl.vision.attention.layer_norm_epsilon", 1e-6, V.FLOAT32),
        ("qwen25vl.vision.num_channels", 3, V.UINT32),
        ("qwen25vl.vision.patch_size", 2, V.UINT32),
        ("qwen25vl.vision.spatial_merge_size", 2, V.UINT32),
        ("qwen25vl.vision.window_size", 112, V.UINT32),
        ("qwen25vl.vision.fullatt_block_indexes", [7, 15, 23, 31], V.ARRAY, V.INT32),
        *tokenizer(16, model="gpt2"),
    ]
    renames = {
        "v.post_ln.weight": "v.merger.ln_q.weight",
        "mm.0.weight": "v.merger.mlp.0.weight",
        "mm.0.bias": "v.merger.mlp.0.bias",
        "mm.2.weight": "v.merger.mlp.2.weight",
        "mm.2.bias": "v.merger.mlp.2.bias",
        "v.blk.0.attn_q.weight": "v.blk.0.attn_q.weight",  # the tower's names already fit
        "v.blk.0.ffn_up.weight": "v.blk.0.ffn_up.weight",
    }
    ts: list[Tensor] = [("token_embd.weight", (16, 64), "Q8_0")]
    ts += [(old, f32(4, 8, seed=i)) for i, old in enumerate(renames.values())]
    ts[-1] = ("v.blk.0.ffn_up.weight", f16(24, 8, seed=30))  # ggml [8, n_ff=24]
    ts += [
        ("v.patch_embd_0.weight", f16(8, 3, 2, 2, seed=31)),
        ("v.patch_embd_1.weight", f16(8, 3, 2, 2, seed=32)),
    ]
    src = write_gguf(tmp_path / "qwen25vl-vision.gguf", "qwen25vl", kvs, ts)
    assert views_of(src).mmproj.handler == "handle_qwen25vl_clip"  # type: ignore[union-attr]
    reader, kv, source = mmproj_of(src, tmp_path)
    assert kv["clip.projector_type"] == "qwen2.5vl_merger"
    assert kv["clip.vision.block_count"] == 1 and kv["clip.vision.embedding_length"] == 8
    assert kv["clip.vision.attention.head_count"] == 2
    assert kv["clip.vision.attention.layer_norm_epsilon"] == pytest.approx(1e-6)
    assert kv["clip.vision.num_channels"] == 3 and kv["clip.vision.patch_size"] == 2
    assert kv["clip.vision.spatial_merge_size"] == 2 and kv["clip.vision.window_size"] == 112
    assert kv["clip.vision.projection_dim"] == 64
    assert kv["clip.vision.feed_forward_length"] == 24  # from ffn_up's shape
    assert kv["clip.vision.n_wa_pattern"] == 8  # fullatt_block_indexes[0] + 1
    assert kv["clip.vision.image_size"] == 560
    assert kv["clip.vision.image_mean"] == pytest.approx(CLIP_MEAN)
    assert kv["clip.vision.image_std"] == pytest.approx(CLIP_STD)
    assert kv["clip.has_vision_encoder"] is True and kv["clip.use_silu"] is True
    got = tensors(reader)
    check_renamed(got, source, renames)
    check_patch_pair(got, source)
    assert sorted(got) == sorted([*renames, "v.patch_embd.weight", "v.patch_embd.weight.1"])


def qwen3vl_vision(tmp_path: Path, arch: str) -> Path:
    """qwen3vl(moe) with its vision tower inline: q and k F16 beside a Q8_0 v, a packed
    two-frame patch embedding, one deepstack adapter, the merger under v.merger.*."""
    kvs: list[KV] = [
        (f"{arch}.block_count", 1, V.UINT32),
        (f"{arch}.embedding_length", 64, V.UINT32),
        (f"{arch}.vision.block_count", 2, V.UINT32),
        (f"{arch}.vision.embedding_length", 32, V.UINT32),
        (f"{arch}.vision.attention.head_count", 2, V.UINT32),
        (f"{arch}.vision.attention.layer_norm_epsilon", 1e-6, V.FLOAT32),
        (f"{arch}.vision.patch_size", 2, V.UINT32),
        (f"{arch}.vision.spatial_merge_size", 2, V.UINT32),
        (f"{arch}.vision.num_channels", 3, V.UINT32),
        (f"{arch}.vision.deepstack_visual_indexes", [1], V.ARRAY, V.INT32),
        (f"{arch}.vision.image_mean", [0.1, 0.2, 0.3], V.ARRAY, V.FLOAT32),
        (f"{arch}.vision.shortest_edge", 1024, V.UINT32),
        *tokenizer(16, model="gpt2"),
    ]
    ts: list[Tensor] = [("token_embd.weight", (16, 64), "Q8_0")]
    for b in range(2):
        ts += [
            (f"v.blk.{b}.attn_q.weight", f16(32, 32, seed=10 * b)),
            (f"v.blk.{b}.attn_k.weight", f16(32, 32, seed=10 * b + 1)),
            (f"v.blk.{b}.attn_v.weight", f32(32, 32, seed=10 * b + 2), "Q8_0"),
        ]
        ts += [
            (f"v.blk.{b}.attn_{x}.bias", f32(32, seed=30 + 10 * b + i)) for i, x in enumerate("qkv")
        ]
        ts += [
            (f"v.blk.{b}.attn_out.weight", f16(32, 32, seed=60 + b)),
            (f"v.blk.{b}.norm1.weight", f32(32, seed=62 + b)),
            (f"v.blk.{b}.norm2.weight", f32(32, seed=64 + b)),
            (f"v.blk.{b}.mlp.linear_fc1.weight", f16(64, 32, seed=66 + b)),  # ggml [32, 64]
            (f"v.blk.{b}.mlp.linear_fc2.weight", f16(32, 64, seed=68 + b)),
        ]
    ts += [
        # numpy [c_out*c_in, frames, h, w] = ggml [w, h, frames, packed]
        ("v.patch_embed.weight", f16(32 * 3, 2, 2, 2, seed=70)),
        ("v.patch_embed.bias", f32(32, seed=71)),
        ("v.pos_embed.weight", f16(16, 32, seed=72)),  # 16 positions: a 4 x 4 grid
        ("v.merger.norm.weight", f32(32, seed=73)),
        ("v.merger.norm.bias", f32(32, seed=74)),
        ("v.merger.linear_fc1.weight", f16(128, 128, seed=75)),
        ("v.merger.linear_fc1.bias", f32(128, seed=76)),
        ("v.merger.linear_fc2.weight", f16(64, 128, seed=77)),
        ("v.merger.linear_fc2.bias", f32(64, seed=78)),
    ]
    for i, leaf in enumerate(("norm", "linear_fc1", "linear_fc2")):
        ts.append((f"v.deepstack_merger.0.{leaf}.weight", f16(8, 8, seed=80 + i)))
        ts.append((f"v.deepstack_merger.0.{leaf}.bias", f32(8, seed=85 + i)))
    return write_gguf(tmp_path / f"{arch}-vision.gguf", arch, kvs, ts)


def dequantized(t: Any) -> np.ndarray:
    """A source tensor's values as F32 (the reference dequantizer for quantized types)."""
    if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return np.asarray(t.data, np.float32).reshape(-1)
    return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(-1)


@pytest.mark.parametrize("arch", ["qwen3vl", "qwen3vlmoe"])
def test_qwen3vl_mmproj_view(tmp_path: Path, arch: str) -> None:
    src = qwen3vl_vision(tmp_path, arch)
    assert views_of(src).mmproj.handler == "handle_qwen3vl_clip"  # type: ignore[union-attr]
    reader, kv, source = mmproj_of(src, tmp_path)
    assert kv["clip.projector_type"] == "qwen3vl_merger"
    assert kv["clip.vision.block_count"] == 2 and kv["clip.vision.embedding_length"] == 32
    assert kv["clip.vision.attention.head_count"] == 2
    assert kv["clip.vision.attention.layer_norm_epsilon"] == pytest.approx(1e-6)
    assert kv["clip.vision.patch_size"] == 2 and kv["clip.vision.spatial_merge_size"] == 2
    assert kv["clip.vision.num_channels"] == 3
    assert kv["clip.vision.temporal_patch_size"] == 2
    assert kv["clip.vision.rope.freq_base"] == pytest.approx(10_000.0)
    assert kv["clip.vision.projection_dim"] == 64
    assert kv["clip.vision.feed_forward_length"] == 64  # from mlp.linear_fc1's shape
    assert kv["clip.vision.image_size"] == 8  # sqrt(16 positions) * patch 2
    assert kv["clip.vision.image_mean"] == pytest.approx([0.1, 0.2, 0.3])  # the file's
    assert kv["clip.vision.image_std"] == [0.5] * 3
    assert kv["clip.vision.image_min_pixels"] == 1024
    assert kv["clip.vision.image_max_pixels"] == 16777216
    assert kv["clip.vision.is_deepstack_layers"] == [False, True]
    assert kv["clip.has_vision_encoder"] is True and kv["clip.use_gelu"] is True
    got = tensors(reader)
    for b in range(2):
        # q, k (F16) and v (Q8_0) each made F32, then one after another: [32, 96] F32.
        w, bias = got[f"v.blk.{b}.attn_qkv.weight"], got[f"v.blk.{b}.attn_qkv.bias"]
        assert list(w.shape) == [32, 96] and list(bias.shape) == [96]
        want = np.concatenate([dequantized(source[f"v.blk.{b}.attn_{x}.weight"]) for x in "qkv"])
        assert np.array_equal(as_f32(w).reshape(-1), want)
        want = np.concatenate([dequantized(source[f"v.blk.{b}.attn_{x}.bias"]) for x in "qkv"])
        assert np.array_equal(as_f32(bias), want)
        for x in "qkv":
            assert f"v.blk.{b}.attn_{x}.weight" not in got  # merged: no orphans
    renames = {
        "v.blk.1.ln1.weight": "v.blk.1.norm1.weight",
        "v.blk.0.ln2.weight": "v.blk.0.norm2.weight",
        "v.blk.0.ffn_up.weight": "v.blk.0.mlp.linear_fc1.weight",
        "v.blk.1.ffn_down.weight": "v.blk.1.mlp.linear_fc2.weight",
        "v.blk.1.attn_out.weight": "v.blk.1.attn_out.weight",
        "v.post_ln.weight": "v.merger.norm.weight",
        "v.post_ln.bias": "v.merger.norm.bias",
        "mm.0.weight": "v.merger.linear_fc1.weight",
        "mm.0.bias": "v.merger.linear_fc1.bias",
        "mm.2.weight": "v.merger.linear_fc2.weight",
        "mm.2.bias": "v.merger.linear_fc2.bias",
        "v.patch_embd.bias": "v.patch_embed.bias",
    }
    for leaf_from, leaf_to in (("norm", "norm"), ("linear_fc1", "fc1"), ("linear_fc2", "fc2")):
        for suffix in ("weight", "bias"):
            # The adapter of deepstack_visual_indexes[0] = 1, by its clip layer.
            renames[f"v.deepstack.1.{leaf_to}.{suffix}"] = (
                f"v.deepstack_merger.0.{leaf_from}.{suffix}"
            )
    check_renamed(got, source, renames)
    packed = np.asarray(source["v.patch_embed.weight"].data).reshape(96, 2, 2, 2)
    for name, frame in (("v.patch_embd.weight", 0), ("v.patch_embd.weight.1", 1)):
        assert list(got[name].shape) == [2, 2, 3, 32]
        want = packed[:, frame].astype(np.float32).reshape(32, 3, 2, 2)
        assert np.array_equal(as_f32(got[name]).reshape(32, 3, 2, 2), want)
    pos = got["v.position_embd.weight"]
    assert np.array_equal(as_f32(pos), np.asarray(source["v.pos_embed.weight"].data, np.float32))
    assert not any(n.startswith(("token_embd", "blk.", "v.deepstack_merger")) for n in got)
    # Per block 7; two patch slices, patch bias, position, post_ln x2, mm.* x4, deepstack 6.
    assert len(got) == 2 * 7 + 10 + 6


def test_glmocr_mmproj_view(tmp_path: Path) -> None:
    kvs: list[KV] = [
        ("glmocr.block_count", 1, V.UINT32),
        ("glmocr.vision.block_count", 1, V.UINT32),
        ("glmocr.vision.embedding_length", 8, V.UINT32),
        ("glmocr.vision.intermediate_size", 24, V.UINT32),
        ("glmocr.vision.attention.head_count", 2, V.UINT32),
        ("glmocr.vision.attention.layer_norm_rms_epsilon", 1e-5, V.FLOAT32),
        ("glmocr.vision.image_size", 336, V.UINT32),
        ("glmocr.vision.patch_size", 14, V.UINT32),
        ("glmocr.vision.spatial_merge_size", 2, V.UINT32),
        ("glmocr.vision.out_hidden_size", 64, V.UINT32),
        ("glmocr.vision.image_mean", CLIP_MEAN, V.ARRAY, V.FLOAT32),
        ("glmocr.vision.image_std", CLIP_STD, V.ARRAY, V.FLOAT32),
        *tokenizer(16, model="gpt2"),
    ]
    names = (
        "v.blk.0.attn_qkv.weight",
        "v.blk.0.attn_out.weight",
        "v.blk.0.ln1.weight",
        "v.blk.0.ffn_gate.weight",
        "v.post_ln.weight",
        "mm.model.fc.weight",
        "mm.up.weight",
        "mm.patch_merger.weight",
    )
    ts: list[Tensor] = [
        ("token_embd.weight", (16, 64), "Q8_0"),
        ("blk.0.ffn_gate.weight", f32(8, 8)),
    ]
    ts += [(n, f16(8, 8, seed=i)) for i, n in enumerate(names)]
    ts += [
        ("v.patch_embd_0.weight", f16(8, 3, 2, 2, seed=20)),
        ("v.patch_embd_1.weight", f16(8, 3, 2, 2, seed=21)),
    ]
    src = write_gguf(tmp_path / "glmocr-vision.gguf", "glmocr", kvs, ts)
    assert views_of(src).mmproj.handler == "handle_glmocr_clip"  # type: ignore[union-attr]
    reader, kv, source = mmproj_of(src, tmp_path)
    assert kv["clip.projector_type"] == "glm4v"
    assert kv["clip.vision.block_count"] == 1 and kv["clip.vision.embedding_length"] == 8
    assert kv["clip.vision.feed_forward_length"] == 24
    assert kv["clip.vision.attention.head_count"] == 2
    assert kv["clip.vision.attention.layer_norm_epsilon"] == pytest.approx(1e-5)
    assert kv["clip.vision.image_size"] == 336 and kv["clip.vision.patch_size"] == 14
    assert kv["clip.vision.spatial_merge_size"] == 2
    assert kv["clip.vision.projection_dim"] == 64
    assert kv["clip.vision.image_mean"] == pytest.approx(CLIP_MEAN)
    assert kv["clip.vision.image_std"] == pytest.approx(CLIP_STD)
    assert kv["clip.has_vision_encoder"] is True and kv["clip.use_silu"] is True
    got = tensors(reader)
    check_renamed(got, source, {n: n for n in names})  # already llama.cpp's names
    check_patch_pair(got, source)
    assert sorted(got) == sorted([*names, "v.patch_embd.weight", "v.patch_embd.weight.1"])


def test_deepseekocr_mmproj_view(tmp_path: Path) -> None:
    kvs: list[KV] = [
        ("deepseekocr.block_count", 1, V.UINT32),
        ("deepseekocr.vision.block_count", 1, V.UINT32),
        ("deepseekocr.vision.embedding_length", 8, V.UINT32),
        ("deepseekocr.vision.head_count", 2, V.UINT32),
        ("deepseekocr.vision.image_size", 224, V.UINT32),
        ("deepseekocr.vision.patch_size", 14, V.UINT32),
        ("deepseekocr.sam.block_count", 1, V.UINT32),
        ("deepseekocr.sam.embedding_length", 16, V.UINT32),
        ("deepseekocr.sam.head_count", 4, V.UINT32),
        *tokenizer(16, model="gpt2"),
    ]
    renames = {
        "v.sam.blk.0.attn.qkv.weight": "s.blk.0.attn.qkv.weight",
        "v.sam.blk.0.attn.out.weight": "s.blk.0.attn.proj.weight",
        "v.sam.blk.0.attn.pos_h.weight": "s.blk.0.attn.rel_pos_h",
        "v.sam.blk.0.attn.pos_w.weight": "s.blk.0.attn.rel_pos_w",
        "v.sam.blk.0.pre_ln.weight": "s.blk.0.norm1.weight",
        "v.sam.blk.0.post_ln.weight": "s.blk.0.norm2.weight",
        "v.sam.pos_embd.weight": "s.position_embd",
        "v.blk.0.attn_qkv.weight": "v.blk.0.self_attn.qkv_proj.weight",
        "v.blk.0.attn_out.weight": "v.blk.0.self_attn.out_proj.weight",
        "v.blk.0.ln1.weight": "v.blk.0.layer_norm1.weight",
        "v.blk.0.ln2.weight": "v.blk.0.layer_norm2.weight",
        "v.blk.0.ffn_up.weight": "v.blk.0.mlp.fc1.weight",
        "v.blk.0.ffn_down.weight": "v.blk.0.mlp.fc2.weight",
        "v.pre_ln.weight": "v.pre_layrnorm.weight",
        "mm.model.fc.weight": "mm.layers.weight",
        "v.image_newline": "mm.image_newline",
        "v.view_seperator": "mm.view_seperator",
    }
    promoted = {
        "v.patch_embd.weight": "v.patch_embd.weight",
        "v.sam.patch_embd.weight": "s.patch_embd.weight",
        "v.position_embd.weight": "v.position_embd.weight",
    }
    ts: list[Tensor] = [("token_embd.weight", (16, 64), "Q8_0"), ("blk.0.attn_q.weight", f32(8, 8))]
    ts += [(old, f16(8, 8, seed=i)) for i, old in enumerate(renames.values())]
    ts += [(old, f16(8, 3, 2, 2, seed=40 + i)) for i, old in enumerate(promoted.values())]
    src = write_gguf(tmp_path / "deepseekocr-vision.gguf", "deepseekocr", kvs, ts)
    reader, kv, source = mmproj_of(src, tmp_path)
    assert kv["clip.projector_type"] == "deepseekocr"
    assert kv["clip.vision.block_count"] == 1 and kv["clip.vision.embedding_length"] == 8
    assert kv["clip.vision.attention.head_count"] == 2
    assert kv["clip.vision.image_size"] == 224 and kv["clip.vision.patch_size"] == 14
    assert kv["clip.vision.sam.block_count"] == 1
    assert kv["clip.vision.sam.embedding_length"] == 16
    assert kv["clip.vision.sam.head_count"] == 4
    # Defaults of the reference mmproj.
    assert kv["clip.vision.feed_forward_length"] == 64
    assert kv["clip.vision.projection_dim"] == 1280
    assert kv["clip.vision.projector.scale_factor"] == 1
    assert kv["clip.vision.window_size"] == 14
    assert kv["clip.vision.attention.layer_norm_epsilon"] == pytest.approx(1e-6)
    assert kv["clip.vision.image_mean"] == [0.5] * 3 and kv["clip.vision.image_std"] == [0.5] * 3
    assert kv["clip.has_vision_encoder"] is True and kv["clip.use_gelu"] is True
    got = tensors(reader)
    check_renamed(got, source, renames)
    for new, old in promoted.items():
        assert np.array_equal(as_f32(got[new]), np.asarray(source[old].data, np.float32))
    assert sorted(got) == sorted([*renames, *promoted])  # no text tensors


def resample_reference(grid: np.ndarray, side: int) -> np.ndarray:
    """Bilinear, corners aligned, weights as C floats: [side, side, E] from [n, n, E]."""
    n = grid.shape[0]
    out = np.zeros((side, side, grid.shape[2]), np.float32)
    one = np.float32(1)
    for y in range(side):
        sy = y * (n - 1) / (side - 1)
        y0 = int(np.floor(sy))
        y1, wy = min(y0 + 1, n - 1), np.float32(sy - y0)
        for x in range(side):
            sx = x * (n - 1) / (side - 1)
            x0 = int(np.floor(sx))
            x1, wx = min(x0 + 1, n - 1), np.float32(sx - x0)
            top = grid[y0, x0] * (one - wx) + grid[y0, x1] * wx
            bottom = grid[y1, x0] * (one - wx) + grid[y1, x1] * wx
            out[y, x] = top * (one - wy) + bottom * wy
    return out


def test_nemotron_h_omni_mmproj_view(tmp_path: Path) -> None:
    e = 8
    kvs: list[KV] = [
        ("nemotron_h_omni.block_count", 1, V.UINT32),
        ("nemotron_h_omni.embedding_length", 64, V.UINT32),
        ("nemotron_h_omni.vision.block_count", 1, V.UINT32),
        ("nemotron_h_omni.vision.embedding_length", e, V.UINT32),
        ("nemotron_h_omni.vision.patch_size", 2, V.UINT32),
        ("nemotron_h_omni.vision.image_size", 8, V.UINT32),  # a 4 x 4 grid of patches
        ("nemotron_h_omni.vision.num_channels", 3, V.UINT32),
        ("nemotron_h_omni.vision.image_mean", [0.1, 0.2, 0.3], V.ARRAY, V.FLOAT32),
        ("nemotron_h_omni.vision.image_token_id", 18, V.UINT32),
        ("nemotron_h_omni.audio.block_count", 1, V.UINT32),
        *tokenizer(16, model="gpt2"),
    ]
    renames = {
        "mm.model.mlp.0.weight": "mm.norm.weight",
        "mm.model.mlp.1.weight": "mm.1.weight",
        "mm.model.mlp.3.weight": "mm.2.weight",
        "v.blk.0.attn_qkv.weight": "v.blk.0.attn_qkv.weight",
    }
    ts: list[Tensor] = [("token_embd.weight", (16, 64), "Q8_0"), ("blk.0.attn_q.weight", f32(8, 8))]
    ts += [(old, f16(8, 8, seed=i)) for i, old in enumerate(renames.values())]
    ts += [
        ("v.cls_embd", f16(e, seed=10)),
        ("v.position_embd", f16(9, e, seed=11)),  # ggml [E, 9]: a 3 x 3 grid, no .weight
        ("v.patch_embd.weight", f16(e, 2 * 2 * 3, seed=12)),  # flat ggml [12, E]
        ("a.blk.0.attn_q.weight", f16(8, 8, seed=13)),
        ("mm.a.fc.weight", f16(8, 8, seed=14)),
    ]
    src = write_gguf(tmp_path / "omni-vision.gguf", "nemotron_h_omni", kvs, ts)
    assert views_of(src).mmproj.handler == "handle_nemotron_h_omni_clip"  # type: ignore[union-attr]
    reader, kv, source = mmproj_of(src, tmp_path)
    assert kv["clip.vision.projector_type"] == "nemotron_v2_vl"
    assert "clip.projector_type" not in kv
    assert kv["clip.vision.block_count"] == 1 and kv["clip.vision.embedding_length"] == e
    assert kv["clip.vision.patch_size"] == 2 and kv["clip.vision.image_size"] == 8
    assert kv["clip.vision.num_channels"] == 3
    assert kv["clip.vision.projection_dim"] == 64
    assert kv["clip.vision.image_token_id"] == 18
    assert kv["clip.vision.image_mean"] == pytest.approx([0.1, 0.2, 0.3])  # the file's
    assert kv["clip.vision.image_std"] == pytest.approx(CLIP_STD)
    # Defaults for what the file lacks.
    assert kv["clip.vision.feed_forward_length"] == 4 * e
    assert kv["clip.vision.attention.head_count"] == 16
    assert kv["clip.vision.attention.layer_norm_epsilon"] == pytest.approx(1e-6)
    assert kv["clip.vision.projector.scale_factor"] == 2
    assert kv["clip.has_vision_encoder"] is True and kv["clip.use_gelu"] is True
    assert kv["clip.has_audio_encoder"] is False  # audio stays off
    got = tensors(reader)
    check_renamed(got, source, renames)
    cls = got["v.class_embd"]
    assert np.array_equal(as_f32(cls), np.asarray(source["v.cls_embd"].data, np.float32))
    # The 3 x 3 position grid resampled to the 4 x 4 the image size makes, as F32 [E, 16].
    pos = got["v.position_embd.weight"]
    assert list(pos.shape) == [e, 16]
    grid = np.asarray(source["v.position_embd"].data, np.float32).reshape(3, 3, e)
    resampled = as_f32(pos).reshape(4, 4, e)
    np.testing.assert_allclose(resampled, resample_reference(grid, 4), rtol=1e-6, atol=1e-7)
    for y, x in ((0, 0), (0, 3), (3, 0), (3, 3)):  # corners aligned: taken as they are
        assert np.array_equal(resampled[y, x], grid[y // 3 * 2, x // 3 * 2])
    # The flat patch kernel as the conv weight [2, 2, 3, E] in F32, elements in place.
    patch = got["v.patch_embd.weight"]
    assert list(patch.shape) == [2, 2, 3, e]
    want = np.asarray(source["v.patch_embd.weight"].data, np.float32).reshape(-1)
    assert np.array_equal(as_f32(patch).reshape(-1), want)
    # Text, audio and the audio projector are not in the view.
    assert sorted(got) == sorted(
        [*renames, "v.class_embd", "v.position_embd.weight", "v.patch_embd.weight"]
    )

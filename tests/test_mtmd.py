"""llama.cpp's own multimodal loader on the mount's `llama.cpp/mmproj.gguf` views.

For each clip family, a tiny but complete model in Ollama's layout (every tensor the
family's clip graph reads, shapes as upstream's converter writes them) is put in a store and
mounted; `mtmd_init_from_file` (libmtmd, through llama-cpp-python) must accept the mounted
`llama.cpp/mmproj.gguf` with the mounted text model and encode one generated bitmap into as
many embeddings as the family's geometry gives, each as wide as the text model's input. The
file as Ollama stores it is refused. llama.cpp runs in a process of its own
(tests/mtmd_probe.py).

What each clip graph reads is from llama.cpp 0c1e570 (the copy llama-cpp-python 0.3.36
builds): tools/mtmd/clip.cpp `load_tensors`, and tools/mtmd/models/siglip.cpp (gemma3),
llava.cpp (mlp), pixtral.cpp (mistral3), llama4.cpp, qwen2vl.cpp (qwen2.5vl_merger),
qwen3vl.cpp (qwen3vl_merger). Ollama's names for Qwen2.5-VL are from ollama/ollama fb30760
convert/convert_qwen25vl.go:65-105 and convert/convert_qwen2.go:65-80.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (scripts/setup)")
pytest.importorskip("llama_cpp.mtmd_cpp", reason="this llama-cpp-python has no libmtmd")

from modelfs.demo.vocab import bpe_vocab, spm_vocab
from tests.builders import TinyStore
from tests.compat_gguf import (
    CLIP_STD,
    KV,
    Tensor,
    V,
    bpe_tokenizer,
    decoder_tensors,
    f16,
    f32,
    gemma3_runnable,
    llava_projector,
    write_gguf,
)
from tests.mounting import fuse, mounted

pytestmark = [fuse, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
TEXT = 64  # every text model's width: the projector's output


def probe(model: Path, mmproj: Path) -> dict[str, Any]:
    r = subprocess.run(
        [sys.executable, "-m", "tests.mtmd_probe", str(model), str(mmproj)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
        check=False,
    )
    lines = [line for line in r.stdout.splitlines() if line.startswith("MTMD ")]
    assert r.returncode == 0 and lines, f"exit {r.returncode}:\n{r.stderr[-3000:]}"
    result: dict[str, Any] = json.loads(lines[-1][5:])
    result["log"] = r.stderr
    return result


def vit_blocks(
    blocks: int,
    width: int,
    ff: int,
    names: tuple[str, str, str, str, str],
    *,
    gate: str | None = None,
    bias: bool = True,
    norm_bias: bool = True,
) -> list[Tensor]:
    """`blocks` ViT blocks: q, k, v and output projections and an MLP of `ff`, two norms;
    `names` = (attention output, first norm, second norm, MLP in, MLP out) as the family's
    file names them."""
    out, norm1, norm2, up, down = names
    ts: list[Tensor] = []
    for b in range(blocks):
        p = f"v.blk.{b}."
        linear = [
            ("attn_q", width, width),
            ("attn_k", width, width),
            ("attn_v", width, width),
            (out, width, width),
            (up, ff, width),
            (down, width, ff),
        ]
        if gate is not None:
            linear.append((gate, ff, width))
        for i, (name, rows, cols) in enumerate(linear):
            seed = 100 * b + 2 * i
            ts.append((f"{p}{name}.weight", f16(rows, cols, seed=seed) * 0.1))
            if bias:
                ts.append((f"{p}{name}.bias", f32(rows, seed=seed + 1) * 0.1))
        for i, name in enumerate((norm1, norm2)):
            ts.append((f"{p}{name}.weight", f32(width, seed=100 * b + 50 + i)))
            if norm_bias:
                ts.append((f"{p}{name}.bias", f32(width, seed=100 * b + 60 + i) * 0.1))
    return ts


def text_kvs(arch: str, heads: int, kv_heads: int, ff: int) -> list[KV]:
    return [
        (f"{arch}.context_length", 4096, V.UINT32),
        (f"{arch}.embedding_length", TEXT, V.UINT32),
        (f"{arch}.block_count", 1, V.UINT32),
        (f"{arch}.feed_forward_length", ff, V.UINT32),
        (f"{arch}.attention.head_count", heads, V.UINT32),
        (f"{arch}.attention.head_count_kv", kv_heads, V.UINT32),
        (f"{arch}.attention.layer_norm_rms_epsilon", 1e-6, V.FLOAT32),
    ]


def text_tensors(
    n_vocab: int,
    heads: int,
    kv_heads: int,
    ff: int,
    *,
    qkv_bias: bool,
    extra: dict[str, tuple[int, ...]] | None = None,
) -> list[Tensor]:
    hd = TEXT // heads
    more = dict(extra or {})
    if qkv_bias:
        more |= {
            "blk.0.attn_q.bias": (heads * hd,),
            "blk.0.attn_k.bias": (kv_heads * hd,),
            "blk.0.attn_v.bias": (kv_heads * hd,),
        }
    return decoder_tensors(n_vocab, TEXT, heads, kv_heads, ff, extra=more)


@dataclass(frozen=True)
class Family:
    name: str  # the model's name in the store
    images: tuple[int, ...]  # the image chunks llama.cpp makes of one bitmap: their tokens
    raw_projector: str  # the file as Ollama stores it, which llama.cpp refuses
    embd: int = TEXT  # the width of one image embedding


def gemma3(tiny: TinyStore, tmp_path: Path) -> Family:
    """A gemma3 with its SigLIP tower inline (Ollama's names, llama.cpp's shapes): 56-pixel
    images in 14-pixel patches, 4x4 patches pooled by 4 into one token."""
    width, ff = 32, 64
    vision_kvs: list[KV] = [
        ("gemma3.vision.block_count", 1, V.UINT32),
        ("gemma3.vision.feed_forward_length", ff, V.UINT32),
        ("gemma3.vision.image_size", 56, V.UINT32),
        ("gemma3.vision.patch_size", 14, V.UINT32),
        ("gemma3.vision.attention.head_count", 2, V.UINT32),
        ("gemma3.vision.attention.layer_norm_epsilon", 1e-6, V.FLOAT32),
    ]
    vision: list[Tensor] = [
        ("v.patch_embedding.weight", f16(width, 3, 14, 14, seed=90)),
        ("v.patch_embedding.bias", f32(width, seed=89)),
        ("v.position_embedding.weight", f16(16, width, seed=91)),
        ("v.post_layernorm.weight", f32(width, seed=88)),
        ("v.post_layernorm.bias", f32(width, seed=87)),
        # HF's mm_input_projection_weight is [vision, text]; llama.cpp transposes it.
        ("mm.mm_input_projection.weight", f16(width, TEXT, seed=92)),
        ("mm.mm_soft_emb_norm.weight", f32(width, seed=93)),
        *vit_blocks(
            1, width, ff, ("attn_output", "layer_norm1", "layer_norm2", "mlp.fc2", "mlp.fc1")
        ),
    ]
    src = gemma3_runnable(tmp_path, vision, vision_kvs)
    cfg = {"model_format": "gguf", "model_family": "gemma3", "file_type": "F32"}
    tiny.legacy("gemma3:vision", tiny.manifest([tiny.layer("model", src.read_bytes())], cfg))
    return Family("gemma3:vision", (1,), "model.gguf")


def llava(tiny: TinyStore, tmp_path: Path) -> Family:
    """A llama text model with a LLaVA projector layer as Ollama ships it (a clip GGUF with
    no projector type): a 2-block CLIP tower with a class embedding, 28-pixel images in
    14-pixel patches (4 tokens; LLaVA reads the second-to-last block), a 2-layer MLP."""
    vocab = spm_vocab(("<unk>", "<s>", "</s>"))
    kvs = [
        *text_kvs("llama", 2, 2, 128),
        ("tokenizer.ggml.model", "llama", V.STRING),
        ("tokenizer.ggml.tokens", list(vocab.tokens), V.ARRAY, V.STRING),
        ("tokenizer.ggml.scores", list(vocab.scores or ()), V.ARRAY, V.FLOAT32),
        ("tokenizer.ggml.token_type", list(vocab.types), V.ARRAY, V.INT32),
        *(
            (f"tokenizer.ggml.{k}_token_id", vocab.specials[t], V.UINT32)
            for k, t in (("unknown", "<unk>"), ("bos", "<s>"), ("eos", "</s>"))
        ),
    ]
    text = write_gguf(
        tmp_path / "llama.gguf",
        "llama",
        kvs,
        text_tensors(len(vocab.tokens), 2, 2, 128, qkv_bias=False),
    )
    width, ff = 32, 64
    clip_kvs: list[KV] = [
        ("clip.vision.feed_forward_length", ff, V.UINT32),
        ("clip.vision.projection_dim", TEXT, V.UINT32),
        ("clip.vision.attention.head_count", 2, V.UINT32),
        ("clip.vision.attention.layer_norm_epsilon", 1e-5, V.FLOAT32),
        ("clip.vision.image_std", CLIP_STD, V.ARRAY, V.FLOAT32),
    ]
    clip_ts: list[Tensor] = [
        ("v.class_embd", f32(width, seed=0)),
        ("v.patch_embd.weight", f16(width, 3, 14, 14, seed=1)),
        ("v.position_embd.weight", f16(5, width, seed=2)),
        ("v.pre_ln.weight", f32(width, seed=3)),
        ("v.pre_ln.bias", f32(width, seed=4)),
        ("mm.0.weight", f16(TEXT, width, seed=5)),
        ("mm.0.bias", f32(TEXT, seed=6)),
        ("mm.2.weight", f16(TEXT, TEXT, seed=7)),
        ("mm.2.bias", f32(TEXT, seed=8)),
        *vit_blocks(2, width, ff, ("attn_out", "ln1", "ln2", "ffn_up", "ffn_down")),
    ]
    projector = llava_projector(tmp_path, *clip_kvs, width=width, blocks=2, tensors=clip_ts)
    layers = [
        tiny.layer("model", text.read_bytes()),
        tiny.layer("projector", projector.read_bytes()),
    ]
    cfg = {"model_format": "gguf", "model_family": "llama", "file_type": "F32"}
    tiny.legacy("llava:tiny", tiny.manifest(layers, cfg))
    return Family("llava:tiny", (4,), "mmproj.gguf")


def qwen25vl(tiny: TinyStore, tmp_path: Path) -> Family:
    """A Qwen2.5-VL with its tower inline, as Ollama's converter writes it (q, k, v split
    from qkv, the patch embedding split per frame, the merger under v.merger.): 14-pixel
    patches merged 2x2, window attention every 2 blocks. llama.cpp resizes the 64-pixel
    bitmap to 84 pixels: 6x6 patches, 3x3 tokens."""
    vocab = bpe_vocab(
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")
    )
    width, ff, blocks = 32, 64, 2
    kvs: list[KV] = [
        *text_kvs("qwen25vl", 2, 1, 128),
        ("qwen25vl.rope.freq_base", 1e6, V.FLOAT32),
        ("qwen25vl.rope.mrope_section", [4, 6, 6], V.ARRAY, V.INT32),
        ("qwen25vl.vision.block_count", blocks, V.UINT32),
        ("qwen25vl.vision.embedding_length", width, V.UINT32),
        ("qwen25vl.vision.attention.head_count", 2, V.UINT32),
        ("qwen25vl.vision.attention.layer_norm_epsilon", 1e-6, V.FLOAT32),
        ("qwen25vl.vision.num_channels", 3, V.UINT32),
        ("qwen25vl.vision.patch_size", 14, V.UINT32),
        ("qwen25vl.vision.spatial_merge_size", 2, V.UINT32),
        ("qwen25vl.vision.window_size", 112, V.UINT32),
        ("qwen25vl.vision.fullatt_block_indexes", [1], V.ARRAY, V.INT32),
        ("qwen25vl.vision.temporal_patch_size", 2, V.UINT32),
        *bpe_tokenizer(vocab, "qwen2", eos=vocab.specials["<|im_end|>"]),
    ]
    merged = 4 * width  # 2x2 patches side by side
    ts = [
        *text_tensors(len(vocab.tokens), 2, 1, 128, qkv_bias=True),
        ("v.patch_embd_0.weight", f16(width, 3, 14, 14, seed=90)),
        ("v.patch_embd_1.weight", f16(width, 3, 14, 14, seed=91)),
        ("v.merger.ln_q.weight", f32(width, seed=92)),
        ("v.merger.mlp.0.weight", f16(merged, merged, seed=93) * 0.1),
        ("v.merger.mlp.0.bias", f32(merged, seed=94)),
        ("v.merger.mlp.2.weight", f16(TEXT, merged, seed=95) * 0.1),
        ("v.merger.mlp.2.bias", f32(TEXT, seed=96)),
        *vit_blocks(
            blocks,
            width,
            ff,
            ("attn_out", "ln1", "ln2", "ffn_up", "ffn_down"),
            gate="ffn_gate",
            norm_bias=False,
        ),
    ]
    src = write_gguf(tmp_path / "qwen25vl.gguf", "qwen25vl", kvs, ts)
    cfg = {"model_format": "gguf", "model_family": "qwen25vl", "file_type": "F32"}
    tiny.legacy("qwen2.5vl:tiny", tiny.manifest([tiny.layer("model", src.read_bytes())], cfg))
    return Family("qwen2.5vl:tiny", (9,), "model.gguf")


def mistral3(tiny: TinyStore, tmp_path: Path) -> Family:
    """A Mistral Small 3.1 style mistral3 with its Pixtral tower inline, as Ollama's converter
    names it (ollama/ollama fb30760 convert/convert_mistral.go:142-173): no biases, RMS norms,
    2D RoPE, a 2x2 patch merger. llama.cpp resizes the 64-pixel bitmap to 96 (8 tokens at
    least): 6x6 16-pixel patches merged to 3x3, an [IMG_BREAK] after each row but the last."""
    vocab = bpe_vocab(("<unk>", "<s>", "</s>", "[IMG]", "[IMG_BREAK]", "[IMG_END]"))
    width, ff = 32, 64
    kvs: list[KV] = [
        *text_kvs("mistral3", 2, 1, 128),
        ("mistral3.rope.freq_base", 1e6, V.FLOAT32),
        ("mistral3.spatial_merge_size", 2, V.UINT32),
        ("mistral3.vision.block_count", 1, V.UINT32),
        ("mistral3.vision.embedding_length", width, V.UINT32),
        ("mistral3.vision.feed_forward_length", ff, V.UINT32),
        ("mistral3.vision.attention.head_count", 2, V.UINT32),
        ("mistral3.vision.image_size", 64, V.UINT32),
        ("mistral3.vision.patch_size", 16, V.UINT32),
        ("mistral3.vision.num_channels", 3, V.UINT32),
        ("mistral3.vision.rope.freq_base", 10000.0, V.FLOAT32),
        *bpe_tokenizer(vocab, "tekken", eos=vocab.specials["</s>"], bos=vocab.specials["<s>"]),
    ]
    ts = [
        *text_tensors(len(vocab.tokens), 2, 1, 128, qkv_bias=False),
        ("v.patch_conv.weight", f16(width, 3, 16, 16, seed=90)),
        ("v.encoder_norm.weight", f32(width, seed=91)),
        ("mm.norm.weight", f32(width, seed=92)),
        ("mm.patch_merger.merging_layer.weight", f16(width, 4 * width, seed=93) * 0.1),
        ("mm.linear_1.weight", f16(TEXT, width, seed=94) * 0.1),
        ("mm.linear_2.weight", f16(TEXT, TEXT, seed=95) * 0.1),
        *vit_blocks(
            1,
            width,
            ff,
            ("attn_output", "attn_norm", "ffn_norm", "ffn_up", "ffn_down"),
            gate="ffn_gate",
            bias=False,
            norm_bias=False,
        ),
    ]
    src = write_gguf(tmp_path / "mistral3.gguf", "mistral3", kvs, ts)
    cfg = {"model_format": "gguf", "model_family": "mistral3", "file_type": "F32"}
    tiny.legacy(
        "mistral-small3.1:tiny", tiny.manifest([tiny.layer("model", src.read_bytes())], cfg)
    )
    return Family("mistral-small3.1:tiny", (11,), "model.gguf")


def qwen3vl_merger(prefix: str, norm: int, merged: int, seed: int) -> list[Tensor]:
    """A norm of `norm` wide, then linear_fc1 and linear_fc2 from `merged` onto the text."""
    return [
        (f"{prefix}.norm.weight", f32(norm, seed=seed)),
        (f"{prefix}.norm.bias", f32(norm, seed=seed + 1)),
        (f"{prefix}.linear_fc1.weight", f16(merged, merged, seed=seed + 2) * 0.1),
        (f"{prefix}.linear_fc1.bias", f32(merged, seed=seed + 3)),
        (f"{prefix}.linear_fc2.weight", f16(TEXT, merged, seed=seed + 4) * 0.1),
        (f"{prefix}.linear_fc2.bias", f32(TEXT, seed=seed + 5)),
    ]


def qwen3vl(tiny: TinyStore, tmp_path: Path) -> Family:
    """A Qwen3-VL (dense) with its tower inline in Ollama's layout: q, k, v apart, the
    two-frame patch embedding packed in one tensor, a learned 4x4 position grid, one
    deepstack adapter (block 1 of 2), the merger under v.merger.; 16-pixel patches merged
    2x2. llama.cpp resizes the 64-pixel bitmap to 96 (8 tokens at least): 3x3 tokens, each
    twice the text width (the deepstack features ride along)."""
    vocab = bpe_vocab(
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")
    )
    width, ff, blocks, patch = 32, 64, 2, 16
    merged = 4 * width
    kvs: list[KV] = [
        *text_kvs("qwen3vl", 2, 1, 128),
        ("qwen3vl.rope.freq_base", 5e6, V.FLOAT32),
        ("qwen3vl.attention.key_length", TEXT // 2, V.UINT32),
        ("qwen3vl.attention.value_length", TEXT // 2, V.UINT32),
        ("qwen3vl.vision.block_count", blocks, V.UINT32),
        ("qwen3vl.vision.embedding_length", width, V.UINT32),
        ("qwen3vl.vision.attention.head_count", 2, V.UINT32),
        ("qwen3vl.vision.attention.layer_norm_epsilon", 1e-6, V.FLOAT32),
        ("qwen3vl.vision.patch_size", patch, V.UINT32),
        ("qwen3vl.vision.spatial_merge_size", 2, V.UINT32),
        ("qwen3vl.vision.num_channels", 3, V.UINT32),
        ("qwen3vl.vision.deepstack_visual_indexes", [1], V.ARRAY, V.INT32),
        ("qwen3vl.vision.shortest_edge", 64 * 64, V.UINT32),
        ("qwen3vl.vision.longest_edge", 256 * 256, V.UINT32),
        *bpe_tokenizer(vocab, "qwen2", eos=vocab.specials["<|im_end|>"]),
    ]
    ts = [
        *text_tensors(
            len(vocab.tokens),
            2,
            1,
            128,
            qkv_bias=False,
            extra={
                "blk.0.attn_q_norm.weight": (TEXT // 2,),
                "blk.0.attn_k_norm.weight": (TEXT // 2,),
            },
        ),
        # numpy [c_out * c_in, frames, h, w]
        ("v.patch_embed.weight", f16(width * 3, 2, patch, patch, seed=90) * 0.1),
        ("v.patch_embed.bias", f32(width, seed=91)),
        ("v.pos_embed.weight", f16(16, width, seed=92)),
        # The merger norms each patch before the 2x2 merge, a deepstack adapter after it.
        *qwen3vl_merger("v.merger", width, merged, seed=93),
        *qwen3vl_merger("v.deepstack_merger.0", merged, merged, seed=80),
        *vit_blocks(
            blocks, width, ff, ("attn_out", "norm1", "norm2", "mlp.linear_fc1", "mlp.linear_fc2")
        ),
    ]
    src = write_gguf(tmp_path / "qwen3vl.gguf", "qwen3vl", kvs, ts)
    cfg = {"model_format": "gguf", "model_family": "qwen3vl", "file_type": "F32"}
    tiny.legacy("qwen3-vl:tiny", tiny.manifest([tiny.layer("model", src.read_bytes())], cfg))
    return Family("qwen3-vl:tiny", (9,), "model.gguf", 2 * TEXT)


def llama4(tiny: TinyStore, tmp_path: Path) -> Family:
    """A llama4 with its ViT inline in Ollama's layout: a linear patch embedding, a class
    embedding, 2D RoPE, pixel shuffle by 2 into a 2-layer adapter and a projection; one dense
    text block (MoE every 2nd). llama.cpp cuts the 64-pixel bitmap into 3x3 tiles of 28
    pixels plus an overview, each a chunk of 2x2 patches shuffled into 1 token."""
    vocab = bpe_vocab(
        (
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|image_start|>",
            "<|image_end|>",
            "<|image|>",
            "<|patch|>",
            "<|tile_x_separator|>",
            "<|tile_y_separator|>",
        )
    )
    width, ff, patch, adapter = 32, 64, 14, 64
    kvs: list[KV] = [
        *text_kvs("llama4", 2, 1, 128),
        ("llama4.rope.freq_base", 5e5, V.FLOAT32),
        ("llama4.rope.dimension_count", TEXT // 2, V.UINT32),
        ("llama4.expert_count", 1, V.UINT32),
        ("llama4.expert_used_count", 1, V.UINT32),
        ("llama4.interleave_moe_layer_step", 2, V.UINT32),
        ("llama4.expert_feed_forward_length", 128, V.UINT32),
        ("llama4.vision.block_count", 1, V.UINT32),
        ("llama4.vision.embedding_length", width, V.UINT32),
        ("llama4.vision.feed_forward_length", ff, V.UINT32),
        ("llama4.vision.attention.head_count", 2, V.UINT32),
        ("llama4.vision.image_size", 2 * patch, V.UINT32),
        ("llama4.vision.patch_size", patch, V.UINT32),
        ("llama4.vision.layer_norm_epsilon", 1e-5, V.FLOAT32),
        ("llama4.vision.pixel_shuffle_ratio", 0.5, V.FLOAT32),
        *bpe_tokenizer(
            vocab,
            "llama-bpe",
            eos=vocab.specials["<|end_of_text|>"],
            bos=vocab.specials["<|begin_of_text|>"],
        ),
    ]
    ts = [
        *text_tensors(len(vocab.tokens), 2, 1, 128, qkv_bias=False),
        ("v.patch_embedding.weight", f16(width, 3 * patch * patch, seed=90) * 0.1),
        ("v.class_embedding", f32(width, seed=91)),
        # F32, as Ollama writes it (ollama/ollama fb30760 convert/reader.go:50).
        ("v.positional_embedding_vlm", f32(5, width, seed=92)),
        ("v.layernorm_pre.weight", f32(width, seed=93)),
        ("v.layernorm_pre.bias", f32(width, seed=94)),
        ("v.layernorm_post.weight", f32(width, seed=95)),
        ("v.layernorm_post.bias", f32(width, seed=96)),
        ("v.vision_adapter.mlp.fc1.weight", f16(adapter, 4 * width, seed=97) * 0.1),
        ("v.vision_adapter.mlp.fc2.weight", f16(adapter, adapter, seed=98) * 0.1),
        ("mm.linear_1.weight", f16(TEXT, adapter, seed=99) * 0.1),
        *vit_blocks(1, width, ff, ("attn_output", "attn_norm", "ffn_norm", "mlp.fc1", "mlp.fc2")),
    ]
    src = write_gguf(tmp_path / "llama4.gguf", "llama4", kvs, ts)
    cfg = {"model_format": "gguf", "model_family": "llama4", "file_type": "F32"}
    tiny.legacy("llama4:tiny", tiny.manifest([tiny.layer("model", src.read_bytes())], cfg))
    return Family("llama4:tiny", (1,) * 10, "model.gguf")


FAMILIES: dict[str, Callable[[TinyStore, Path], Family]] = {
    "gemma3": gemma3,
    "llama4": llama4,
    "llava": llava,
    "mistral3": mistral3,
    "qwen25vl": qwen25vl,
    "qwen3vl": qwen3vl,
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_llama_cpp_encodes_an_image_with_the_mounted_projector_view(
    tmp_path: Path, family: str
) -> None:
    tiny = TinyStore(tmp_path / "models")
    fam = FAMILIES[family](tiny, tmp_path)
    model, tag = fam.name.split(":")
    mnt = tmp_path / "mnt"
    with mounted(tiny.root, mnt):
        d = mnt / model / tag
        view_text = d / "llama.cpp" / "model.gguf"
        text = view_text if view_text.exists() else d / "model.gguf"
        got = probe(text, d / "llama.cpp" / "mmproj.gguf")
        assert got["loaded"] and got["vision"], got["log"][-3000:]
        assert got["n_embd_text"] == TEXT
        assert got["n_embd_inp"] == fam.embd
        assert got["images"] == [{"tokens": n, "finite": True, "nonzero": True} for n in fam.images]
        # What the view is for: the projector as Ollama stores it, llama.cpp refuses.
        raw = probe(text, d / fam.raw_projector)
        assert raw["text_model"] and not raw["loaded"]

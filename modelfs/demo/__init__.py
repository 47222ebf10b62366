"""Build a small but realistic Ollama model store, for tests, demos and benchmarks.

    build_demo_store(root) -> DemoStore          a few MB, well under 2 s
    build_demo_store(root, weight_bytes=4 << 30) the first model's GGUF is ~4 GiB
    python -m modelfs.demo DIR [--size small|64M|1G|4G] [--json]

What lands in the store (every blob through `store.blobs.BlobStore`, so nothing is half-written
and every name is its sha256):

`gemma4:26b`, as a store looks after Ollama's manifest-list migration:
    `manifests-v2/ollama.com/library/gemma4/26b` -> relative symlink to a manifest-list blob
    (`application/vnd.ollama.manifest.list.v2+json`) whose two children are references to
    manifest blobs:
      llamacpp / gguf         model.gguf (arch gemma4, Q4_K_M: Q4_K, Q6_K, F32 tensors, MoE
                              expert tensors), mmproj.gguf (arch clip, F16), draft.gguf (Q8_0),
                              template, license, params
      mlx / safetensors       one `application/vnd.ollama.image.tensor` layer per tensor, each a
                              safetensors blob laid out as Ollama's x/create writes it (NVFP4
                              packed weights with `.scale` and `.global_scale` companions, BF16
                              norms and embeddings), `application/vnd.ollama.image.json` layers
                              (config.json, tokenizer.json, tokenizer_config.json,
                              generation_config.json, draft/config.json), template, license,
                              params
    `manifests/registry.ollama.ai/library/gemma4/26b`, the legacy downgrade anchor: the
    llamacpp child's manifest plus layers that reference the list blob and both child manifest
    blobs, so an old Ollama's prune keeps them. It is hidden by the v2 entry.
    `manifests/registry.ollama.ai/library/gemma4/26b-mlx`: the mlx child's own bytes, so that
    prune keeps the mlx variant's blobs too (`gemma4:26b-mlx` to `ollama list`). The tag is
    written by `store.listtag.write_list_tag`, as `modelfs pull --all-variants` writes it.
`llama3.2:3b` (Q4_K_M) and `qwen3:0.6b` (Q8_0): legacy manifests sharing template and license
    blobs. **`llama3.2:3b`'s model blob is the one llama.cpp can load vocabulary-only**: arch
    `llama`, a byte-level BPE (`gpt2`, pre `llama-bpe`) vocabulary with all 256 byte tokens,
    merges whose every result is a token, and control tokens for bos/eos/eot. Every model.gguf
    and draft.gguf here runs in llama.cpp: tests/test_llama.py generates tokens greedily from
    each, from its blob and through a mount, and compares them (llama-cpp-python 0.3.36). The
    weights are seeded noise, so the tokens are gibberish; the mmproj is not run there.
`someuser/tiny:q8`: a user namespace, with a system prompt layer.
`hf.co/bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M`: another host; its 576-wide rows cannot use
    K-quants, so its Q4_K_M is Q5_0/Q8_0, as llama.cpp's quantizer falls back.

Blob bytes are deterministic (seeded generators, no clocks); manifest mtimes are fixed,
distinct dates so that "newest first" can be tested.

The package, one module per model family:
    records     what was written (DemoStore and its parts), the names and dates
    ggufspec    GGUF files from a spec (tensors of noise, headers by gguf's writer)
    vocab       tokenizer vocabularies and chat templates
    writer      blobs, configs and manifests into the store
    gemma       gemma4:26b, its manifest list, GGUF child and legacy anchor
    gemma_mlx   gemma4:26b@mlx's safetensors and JSON layers
    llama       llama3.2:3b, someuser/tiny:q8, hf.co/…/SmolLM2
    qwen        qwen3:0.6b
    build       build_demo_store: all of them into one store
    cli         main, for `python -m modelfs.demo` and `modelfs demo-store`
"""

from modelfs.demo.build import build_demo_store
from modelfs.demo.cli import main, parse_size
from modelfs.demo.records import (
    GEMMA,
    GEMMA_MLX,
    LLAMA,
    QWEN,
    SMOL,
    TINY,
    VOCAB_ONLY_MODEL,
    DemoLayer,
    DemoList,
    DemoManifest,
    DemoStore,
)

__all__ = [
    "GEMMA",
    "GEMMA_MLX",
    "LLAMA",
    "QWEN",
    "SMOL",
    "TINY",
    "VOCAB_ONLY_MODEL",
    "DemoLayer",
    "DemoList",
    "DemoManifest",
    "DemoStore",
    "build_demo_store",
    "main",
    "parse_size",
]

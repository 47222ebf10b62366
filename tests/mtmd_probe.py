"""llama.cpp's own multimodal loader (libmtmd, through llama-cpp-python's `llama_cpp.mtmd_cpp`)
on a text model and a projector: load both, tokenize a prompt with one image (a generated
bitmap), encode the image. Run as a process of its own, so that a GGML_ASSERT abort in
llama.cpp fails one test rather than the test run:

    python -m tests.mtmd_probe MODEL MMPROJ [--size WxH]

prints one JSON line, `MTMD {"loaded": bool, "text_model": bool, "vision": bool,
"n_embd_text": n, "n_embd_inp": n, "images": [{"tokens", "finite", "nonzero"}]}`; exits 0
whether or not llama.cpp accepted the files.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np


def probe(model_path: str, mmproj_path: str, width: int, height: int) -> dict[str, Any]:
    import llama_cpp
    from llama_cpp import mtmd_cpp as mtmd

    model = llama_cpp.llama_model_load_from_file(
        model_path.encode(), llama_cpp.llama_model_default_params()
    )
    if not model:
        return {"loaded": False, "text_model": False}
    try:
        params = mtmd.mtmd_context_params_default()
        params.use_gpu = False
        params.n_threads = 2
        params.warmup = False
        ctx = mtmd.mtmd_init_from_file(mmproj_path.encode(), model, params)
        out: dict[str, Any] = {
            "loaded": bool(ctx),
            "text_model": True,
            "n_embd_text": llama_cpp.llama_model_n_embd(model),
            # What one image embedding is wide: the text width, times (1 + deepstack layers).
            "n_embd_inp": llama_cpp.llama_model_n_embd_inp(model),
        }
        if not ctx:
            return out
        try:
            out["vision"] = bool(mtmd.mtmd_support_vision(ctx))
            out["images"] = _encode_one(mtmd, ctx, width, height, out["n_embd_inp"])
        finally:
            mtmd.mtmd_free(ctx)
        return out
    finally:
        llama_cpp.llama_model_free(model)


def _encode_one(mtmd: Any, ctx: Any, width: int, height: int, n_embd: int) -> list[Any]:
    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    raw = pixels.tobytes()
    bitmap = mtmd.mtmd_bitmap_init(width, height, (ctypes.c_uint8 * len(raw)).from_buffer_copy(raw))
    chunks = mtmd.mtmd_input_chunks_init()
    try:
        prompt = mtmd.mtmd_default_marker() + b" what is in this picture?"
        text = mtmd.mtmd_input_text(
            text=prompt, text_len=len(prompt), add_special=True, parse_special=True
        )
        bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
        rc = mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1)
        if rc != 0:
            return [{"tokenize": rc}]
        images = []
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            if mtmd.mtmd_input_chunk_get_type(chunk) != mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                continue
            tokens = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
            rc = mtmd.mtmd_encode_chunk(ctx, chunk)
            if rc != 0:
                images.append({"encode": rc})
                continue
            embd = np.ctypeslib.as_array(mtmd.mtmd_get_output_embd(ctx), shape=(tokens * n_embd,))
            images.append(
                {
                    "tokens": tokens,
                    "finite": bool(np.isfinite(embd).all()),
                    "nonzero": bool(np.abs(embd).max() > 0),
                }
            )
        return images
    finally:
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_bitmap_free(bitmap)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mtmd_probe")
    ap.add_argument("model")
    ap.add_argument("mmproj")
    ap.add_argument("--size", default="64x64", help="the bitmap's WIDTHxHEIGHT")
    args = ap.parse_args(argv)
    width, height = (int(v) for v in args.size.split("x"))
    result = probe(args.model, args.mmproj, width, height)
    sys.stdout.flush()
    print("MTMD " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

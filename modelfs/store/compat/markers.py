"""What marks a GGUF of an architecture as Ollama's layout, as data (`Markers`): the shape
every detect_ollama_<arch> of ollama/ollama `llama/compat/llama-ollama-compat.cpp` (main @
fb30760) shares, used by the rule modules of store.compat.
"""

from __future__ import annotations

from dataclasses import dataclass

from modelfs.store.compat.draft import Draft


@dataclass(frozen=True, slots=True)
class Markers:
    """What marks a GGUF of `arch` as Ollama's layout (a detect_ollama_<arch> as data): any
    one of these keys present, a tensor under one of these prefixes, one of these keys
    missing, or a string key holding one of these values."""

    arch: str
    keys: tuple[str, ...] = ()
    prefixes: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    strings: tuple[tuple[str, str], ...] = ()
    always: bool = False  # the architecture name alone is the marker

    def __call__(self, d: Draft) -> bool:
        if d.str_value("general.architecture") != self.arch:
            return False
        return (
            self.always
            or any(d.has_key(k) for k in self.keys)
            or any(d.any_tensor_with_prefix(p) for p in self.prefixes)
            or any(not d.has_key(k) for k in self.missing)
            or any(d.string_equals(k, v) for k, v in self.strings)
        )


# Where a GGUF keeps vision tensors inline (a detector of several architectures looks there).
VISION_PREFIXES = ("v.", "mm.")

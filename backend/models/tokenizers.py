"""Tokenizers built in code (no vocab files ship anywhere and no hub is reachable).

Byte-level CLIP BPE with every byte symbol and a few hundred frequent English merges, and a
SentencePiece-style T5 unigram vocabulary of letters and common words. Deterministic: the same
text always gives the same ids.
"""

from __future__ import annotations

import hashlib
import json
from functools import cache

from transformers import CLIPTokenizer, T5Tokenizer

PRINTABLE_ASCII = "".join(chr(code) for code in range(ord("!"), ord("~") + 1))
COMMON_WORDS = (
    "a an the of and in on with to at for from by is red blue green yellow black white orange "
    "purple brown gray pink cat dog bird car house tree flower vase lamp chair armchair table sofa "
    "wall stone wood leather glass metal sky water grass sun moon cloud mountain river road city "
    "street window door hat shirt dress face hair eye hand photo painting style bright dark light "
    "small large old new beautiful"
).split()


def _byte_symbols() -> list[str]:
    """The 256 printable stand-ins byte-level BPE uses for raw bytes (GPT-2 convention)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes, extra = printable[:], 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return [chr(code) for code in codes]


def _clip_merges() -> list[str]:
    """Merges that spell each common word left to right, ending in the word-final '</w>' form."""
    merges: list[str] = []
    seen: set[str] = set()
    for word in COMMON_WORDS:
        current = word[0]
        for index, char in enumerate(word[1:], start=1):
            right = char + ("</w>" if index == len(word) - 1 else "")
            merge = f"{current} {right}"
            if merge not in seen:
                seen.add(merge)
                merges.append(merge)
            current += right
    return merges


def build_clip_tokenizer(max_length: int = 77) -> CLIPTokenizer:
    symbols = _byte_symbols()
    vocab: dict[str, int] = {}
    for symbol in symbols + [s + "</w>" for s in symbols]:
        vocab.setdefault(symbol, len(vocab))
    for merge in _clip_merges():
        vocab.setdefault(merge.replace(" ", ""), len(vocab))
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    merges = [tuple(m.split(" ")) for m in _clip_merges()]
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)


@cache
def clip_vocab_size() -> int:
    return len(build_clip_tokenizer().get_vocab())


def build_t5_tokenizer(max_length: int = 512) -> T5Tokenizer:
    """Unigram vocabulary: pad/eos/unk at ids 0/1/2 (the T5 convention), common words, every
    printable ASCII character alone and after the word-start marker; other characters are <unk>."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + word, -5.0) for word in COMMON_WORDS]
    pieces += [(char, -8.0) for char in PRINTABLE_ASCII]
    pieces += [("▁" + char, -9.0) for char in PRINTABLE_ASCII]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length)


@cache
def t5_vocab_size() -> int:
    return len(build_t5_tokenizer().get_vocab())


@cache
def tokenizer_fingerprint() -> str:
    """Hash of both vocabularies (and CLIP merges): part of a built model's revision."""
    clip, t5 = build_clip_tokenizer(), build_t5_tokenizer()
    text = json.dumps(
        [sorted(clip.get_vocab().items()), _clip_merges(), sorted(t5.get_vocab().items())]
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]

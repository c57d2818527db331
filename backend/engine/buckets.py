"""Static step shapes: the few sizes a batch's rows and masked-token counts are padded up to.

A step whose shapes come from a small set can be replayed from a captured graph or a compiled
kernel per shape instead of being launched operator by operator. Plain Python, no torch.

Rules:
* rows: a batch of ``n`` requests runs as ``row_bucket(n)`` requests, the next power of two (the
  added requests repeat the last one and their outputs are dropped);
* tokens: on a grid of ``num_tokens`` tokens, a batch whose longest row selects ``n`` tokens runs
  every row with ``token_bucket(n, num_tokens)`` tokens. Buckets are ``m * 2**k`` for
  ``m`` in ``[per_octave, 2 * per_octave)``: ``per_octave`` sizes between two powers of two, so a
  row computes at most ``1 / per_octave`` more tokens than it selects; every count up to
  ``2 * per_octave`` is its own bucket, and no bucket exceeds ``num_tokens``.

Invariants: ``n <= token_bucket(n, L) <= L`` and ``n <= row_bucket(n)``; both are monotonic, so
a batch's bucket is the bucket of its longest row.
"""

from __future__ import annotations

TOKENS_PER_OCTAVE = 4


def row_bucket(requests: int) -> int:
    """The number of requests a batch of ``requests`` runs as: the next power of two."""
    if requests < 1:
        raise ValueError(f"a batch has at least one request, got {requests}")
    return 1 << (requests - 1).bit_length()


def token_bucket(count: int, num_tokens: int, per_octave: int = TOKENS_PER_OCTAVE) -> int:
    """Tokens every row computes on a grid of ``num_tokens`` when the longest row selects
    ``count``."""
    if not 0 < count <= num_tokens:
        raise ValueError(f"a row selects 1 to {num_tokens} tokens, got {count}")
    if per_octave < 1 or per_octave & (per_octave - 1):
        raise ValueError(f"per_octave must be a power of two, got {per_octave}")
    if count <= 2 * per_octave:
        return count
    # count lies in (2**j, 2**(j + 1)]; that octave's buckets are multiples of 2**j / per_octave
    step = 1 << ((count - 1).bit_length() - per_octave.bit_length())
    return min(num_tokens, -(-count // step) * step)


STEP_SHAPES = ("auto", "exact", "bucketed")


def check_step_shapes(choice: str) -> str:
    if choice not in STEP_SHAPES:
        raise ValueError(f"step shapes {choice!r} are not known: use {', '.join(STEP_SHAPES)}")
    return choice


def buckets_steps(choice: str, device_type: str) -> bool:
    """Whether a step on a ``device_type`` device runs bucketed: ``auto`` buckets on CUDA, whose
    steps are bound by launching operators, not on the CPU, which would compute the padding."""
    return choice == "bucketed" or (choice == "auto" and device_type == "cuda")

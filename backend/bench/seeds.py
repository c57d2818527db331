"""The seeds of a multi-seed bench run, as a user writes them (``--seeds``) and as plots show them.

Pure: no I/O. A bench with ``--seeds`` runs once per seed, writes each run's JSON beside the mean.
"""

from __future__ import annotations


def parse_seeds(text: str, default: int) -> list[int]:
    """The seeds ``text`` names: a comma list of integers and inclusive ranges ("0,1,2", "3-12",
    "0,5-7"), in the order written; ``[default]`` when ``text`` is empty. Raises ValueError saying
    what to write for anything else, a range running backwards, or a seed named twice."""
    if not text:
        return [default]
    seeds: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            low = int(first)
            high = int(last) if dash else low
        except ValueError:
            raise ValueError(
                f"--seeds takes integers and ranges, e.g. 0,1,2 or 3-12; got {text!r}"
            ) from None
        if high < low:
            raise ValueError(f"--seeds range {part.strip()!r} runs backwards: write {high}-{low}")
        seeds.extend(range(low, high + 1))
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds repeats a seed: {text!r}")
    return seeds


def seed_span(seeds: list[int]) -> str:
    """``seeds`` as a reader scans them: "3-12" for a run of three or more consecutive seeds,
    else "0, 2, 5"."""
    if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}-{seeds[-1]}"
    return ", ".join(str(s) for s in seeds)

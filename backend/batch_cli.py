"""`maskserve submit --masks DIR` / `--prompts FILE`: one template, many edits, one batch.

Masks: every image file in DIR (by suffix, see ``MASK_SUFFIXES``), sorted by name. Prompts: one
per line of FILE (blank lines skipped). They pair into items as the server pairs them
(``backend.api.batch_items``): checked here first, so a mismatch is said before anything is sent.
Progress is one bar over the whole batch (tqdm, on stderr; it only moves forward: ``advance``);
once every item finished, the results zip is unpacked into the output directory (``<index>.png``
and ``manifest.json``, which lists every item, failed ones with their message).
"""

from __future__ import annotations

import io
import json
import math
import sys
import zipfile
from pathlib import Path

from tqdm import tqdm

from backend.api.batch_items import PairingError, pair_items

# the upload formats the server decodes (backend.imaging.uploads.ALLOWED_FORMATS), by file suffix
MASK_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


class BatchInputError(ValueError):
    """The masks folder or the prompts file cannot make a batch: the message says why."""


def mask_files(folder: str | Path) -> list[Path]:
    """Every image file directly in ``folder``, sorted by name."""
    path = Path(folder)
    if not path.is_dir():
        raise BatchInputError(f"--masks {folder}: not a directory")
    found = sorted(
        (f for f in path.iterdir() if f.is_file() and f.suffix.lower() in MASK_SUFFIXES),
        key=lambda f: f.name,
    )
    if not found:
        raise BatchInputError(
            f"--masks {folder}: no image files ({', '.join(MASK_SUFFIXES)}) in it"
        )
    return found


def prompt_lines(file: str | Path) -> list[str]:
    """One prompt per non-blank line of ``file``."""
    try:
        lines = Path(file).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise BatchInputError(f"--prompts {file}: cannot be read ({exc})") from None
    prompts = [line.strip() for line in lines if line.strip()]
    if not prompts:
        raise BatchInputError(f"--prompts {file}: no prompts in it (one per line)")
    return prompts


def batch_inputs(args) -> tuple[list[Path], list[str], Path | None]:
    """(mask files, prompts, the one shared mask) of ``args``; the counts are checked to pair."""
    masks = mask_files(args.masks) if getattr(args, "masks", None) else []
    prompts = prompt_lines(args.prompts) if getattr(args, "prompts", None) else []
    shared = Path(args.mask) if getattr(args, "mask", None) else None
    if masks and shared is not None:
        raise BatchInputError("give --masks DIR or --mask FILE, not both")
    try:
        pair_items(len(masks), len(prompts), shared is not None)
    except PairingError as exc:
        raise BatchInputError(f"{exc} (--masks gives the masks, --prompts the prompts)") from None
    return masks, prompts, shared


def unpack(zipped: bytes, out: Path) -> list[str]:
    """Write the zip's files (``<index>.png``, ``manifest.json``) into ``out``; a name with a
    directory part is skipped, so nothing lands outside ``out``."""
    written = []
    with zipfile.ZipFile(io.BytesIO(zipped)) as archive:
        for name in archive.namelist():
            if Path(name).name == name and not name.startswith("."):
                (out / name).write_bytes(archive.read(name))
                written.append(name)
    return written


def advance(bar: tqdm, progress: float, total: int) -> None:
    """Show ``progress`` (0..1, the batch's) of ``total`` items on ``bar``, only ever forward.
    A batch's progress may go down (a reconnect replays its items' events from the start, a
    redelivered item starts its steps again), so the bar holds still until the batch is past
    where it was. The count is floored to two decimals (shown whole once it is), so it reads
    2.97/3, never 2.9798999999999998/3, and reaches the total only when every item finished."""
    count = math.floor(progress * total * 100) / 100
    if count > bar.n:
        bar.n = int(count) if count.is_integer() else count


def run_batch(client, args, params: dict) -> int:
    """Submit the batch, follow it with a progress bar, unpack its results; prints JSON lines
    (the accepted batch, then a report). 0: every item done (or submitted, with --no-wait),
    1: some failed or were cancelled, 2: the masks or prompts cannot make a batch."""
    try:
        masks, prompts, shared = batch_inputs(args)
    except BatchInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    accepted = client.submit_batch(
        masks=masks,
        prompts=prompts,
        mask=shared,
        prompt=getattr(args, "prompt", "") or "",
        template_id=getattr(args, "template_id", None),
        image=getattr(args, "image", None),
        **params,
    )
    batch_id = accepted["batch_id"]
    print(json.dumps({k: accepted[k] for k in ("batch_id", "status", "status_url")}), flush=True)
    if not getattr(args, "wait", True):
        return 0
    total = len(accepted["items"])
    with tqdm(total=total, unit="item", desc=f"batch {batch_id[:8]}", file=sys.stderr) as bar:

        def on_event(message: dict) -> None:
            if message.get("type") == "batch":
                advance(bar, message["progress"], total)  # partial items count as fractions
                bar.set_postfix(done=message["counts"].get("done", 0), refresh=False)
                bar.refresh()

        timeout = getattr(args, "timeout", None) or 3600.0
        final = client.wait_batch(batch_id, timeout=timeout, on_event=on_event)
        on_event({"type": "batch", **final})
    out = Path(getattr(args, "out", None) or f"batch-{batch_id}")
    out.mkdir(parents=True, exist_ok=True)
    unpack(client.batch_zip(batch_id), out)
    names = [m.name for m in masks]
    report = {
        "batch_id": batch_id,
        "status": final["status"],
        "counts": final["counts"],
        "out": str(out),
        "items": [
            {"index": item["index"], "status": item["status"]}
            | ({"mask": names[item["index"]]} if len(names) == total else {})
            | ({"message": item["message"]} if item["status"] != "done" else {})
            for item in final["items"]
        ],
    }
    print(json.dumps(report), flush=True)
    return 0 if final["status"] == "done" else 1

"""The safetensors container of an adapter upload, read without a model library: the API refuses
a file that is not one before a CPU worker sees it, and the worker's reader starts from the same
check (``backend.adapters.files``).
"""

from __future__ import annotations

from pathlib import Path

from safetensors import SafetensorError, safe_open

from backend.adapters.store import AdapterError


def safetensors_keys(path: Path | str) -> list[str]:
    """The tensor names in the file's header (no tensor is loaded, no model library imported);
    ``AdapterError`` (``unsupported_format``) when it is not a readable safetensors file."""
    try:
        with safe_open(str(path), framework="numpy") as handle:
            return list(handle.keys())
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(
            f"the file is not a readable .safetensors file ({exc}): upload the adapter's "
            ".safetensors file, whole (a truncated or corrupt download fails here too)",
            "unsupported_format",
        ) from None

"""`maskserve adapters add FILE|DIR | list | show ID | rm ID`: the adapter registry over REST.

``add`` of a directory uploads every ``.safetensors`` in it (sorted by name; not recursive), each
under its file's name unless ``--name`` is given (one file only). Prints one JSON line per adapter.
Exit status: 0 all done, 2 a refusal (the server's message) or an unreachable server; with a
directory every file is tried, and the status is 2 when any was refused.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx

from backend.client import MaskServeClient, MaskServeError, add_connection_arguments, connection


def add_adapter_parser(sub) -> None:
    adapters = sub.add_parser("adapters", help="register, list, inspect and delete LoRA adapters")
    actions = adapters.add_subparsers(dest="action", required=True)
    add = actions.add_parser("add", help="upload a .safetensors adapter, or every one in a folder")
    add.add_argument("path", help="a .safetensors file or a directory of them")
    add.add_argument("--model", default=None, help="model the adapter is for (default: served)")
    add.add_argument("--name", default=None, help="display name (default: the file's name)")
    actions.add_parser("list", help="your adapters, newest first")
    show = actions.add_parser("show", help="one adapter: family, ranks, targeted modules, size")
    show.add_argument("adapter_id")
    remove = actions.add_parser("rm", help="delete an adapter")
    remove.add_argument("adapter_id")
    for action in actions.choices.values():
        add_connection_arguments(action)
    adapters.set_defaults(func=adapters_cli)


def adapter_files(path: Path) -> list[Path]:
    """``path`` itself, or the ``.safetensors`` files of a directory sorted by name."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix == ".safetensors" and p.is_file())
        if not files:
            raise ValueError(f"{path} holds no .safetensors files")
        return files
    if not path.is_file():
        raise ValueError(f"{path} is neither a file nor a directory")
    return [path]


def _add(client: MaskServeClient, args) -> int:
    files = adapter_files(Path(args.path))
    if args.name is not None and len(files) > 1:
        raise ValueError("--name names one adapter: give a file, not a directory")
    status = 0
    for path in files:
        try:
            record = client.upload_adapter(path, name=args.name, model=args.model)
        except MaskServeError as exc:
            print(f"error: {path.name}: {exc.message} (HTTP {exc.status})", file=sys.stderr)
            status = 2
            continue
        print(json.dumps({"file": str(path)} | record), flush=True)
    return status


def adapters_cli(args, settings=None) -> int:
    url, api_key = connection(args, settings)
    try:
        with MaskServeClient(url, api_key) as client:
            if args.action == "add":
                return _add(client, args)
            if args.action == "list":
                for record in client.list_adapters():
                    print(json.dumps(record), flush=True)
            elif args.action == "show":
                print(json.dumps(client.get_adapter(args.adapter_id), indent=2), flush=True)
            else:
                client.delete_adapter(args.adapter_id)
                print(json.dumps({"deleted": args.adapter_id}), flush=True)
            return 0
    except MaskServeError as exc:
        print(f"error: {exc.message} (HTTP {exc.status})", file=sys.stderr)
        return 2
    except (httpx.TransportError, OSError) as exc:
        print(f"error: cannot reach {url} or read a file: {exc}", file=sys.stderr)
        return 2

"""A small Python client for the MaskServe REST API, and `maskserve submit`.

    client = MaskServeClient("http://127.0.0.1:8000", api_key="...")
    template = client.upload_template("room.png", name="Living room", tags=["interior"])
    job = client.submit(
        mask="mask.png", prompt="a red armchair", template_id=template["id"], seed=42
    )
    final = client.wait(job["job_id"], timeout=300)      # follows the job's event stream
    open("out.png", "wb").write(client.result_bytes(job["job_id"]))

Files may be given as paths or bytes. Errors from the server raise ``MaskServeError`` with its
status and the server's message.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

from backend.config import API_KEY_DIGEST_PREFIX

TERMINAL = ("done", "failed", "cancelled")
UPLOAD_TIMEOUT_S = 600.0  # an adapter upload: sending up to hundreds of MB, then its validation


class MaskServeError(RuntimeError):
    """``status`` and the server's ``message``; ``retry_after`` (seconds, from ``Retry-After``) on
    a 429, ``detail`` the error body's other fields (a refusal by admission control: ``reason``,
    ``predicted_latency_s``, ``deadline_s``, ...)."""

    def __init__(
        self,
        status: int,
        message: str,
        retry_after: float | None = None,
        detail: dict | None = None,
    ):
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message = status, message
        self.retry_after, self.detail = retry_after, detail or {}


def _error_of(response: httpx.Response) -> MaskServeError:
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        return MaskServeError(response.status_code, response.text)
    message = body.pop("error", response.text)
    try:
        retry_after = float(response.headers["Retry-After"])
    except (KeyError, ValueError):
        retry_after = None
    return MaskServeError(response.status_code, message, retry_after, body)


def _file_bytes(value: str | Path | bytes) -> bytes:
    return value if isinstance(value, (bytes, bytearray)) else Path(value).read_bytes()


def _file_name(value: str | Path | bytes, default: str) -> str:
    return default if isinstance(value, (bytes, bytearray)) else Path(value).name


def _form_value(value) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _edit_fields(prompt: str, template_id: str | None, params: dict) -> dict:
    """The form fields of an edit's prompt, template and parameters (None values left out)."""
    adapters = params.pop("adapters", None)
    data = {"prompt": prompt} | {k: _form_value(v) for k, v in params.items() if v is not None}
    if adapters:
        data["adapters"] = adapters_field(adapters)
    if template_id is not None:
        data["template_id"] = template_id
    return data


class MaskServeClient:
    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout: float = 60.0,
        transport: httpx.BaseTransport | None = None,
    ):
        headers = {"X-API-Key": api_key} if api_key else {}
        self.http = httpx.Client(
            base_url=base_url.rstrip("/"), headers=headers, timeout=timeout, transport=transport
        )

    def close(self) -> None:
        self.http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, method: str, url: str, **kwargs) -> httpx.Response:
        response = self.http.request(method, url, **kwargs)
        if response.status_code >= 400:
            raise _error_of(response)
        return response

    # ----- adapters -------------------------------------------------------------------------------
    def upload_adapter(
        self, file: str | Path | bytes, name: str | None = None, model: str | None = None
    ) -> dict:
        """Register a LoRA adapter (.safetensors); returns its record. The server reads and
        validates it before answering (up to its ``adapters.ingest_timeout_s``)."""
        data = {k: v for k, v in (("name", name), ("model", model)) if v is not None}
        files = {"file": (_file_name(file, "adapter.safetensors"), _file_bytes(file))}
        return self._call(
            "POST", "/v1/adapters", data=data, files=files, timeout=UPLOAD_TIMEOUT_S
        ).json()

    def list_adapters(self) -> list[dict]:
        return self._call("GET", "/v1/adapters").json()["adapters"]

    def get_adapter(self, adapter_id: str) -> dict:
        return self._call("GET", f"/v1/adapters/{adapter_id}").json()

    def delete_adapter(self, adapter_id: str) -> None:
        self._call("DELETE", f"/v1/adapters/{adapter_id}")

    # ----- templates ------------------------------------------------------------------------------
    def upload_template(self, image: str | Path | bytes, name: str | None = None, tags=()) -> dict:
        data = {"tags": ",".join(tags)} | ({"name": name} if name is not None else {})
        files = {"file": (_file_name(image, "template.png"), _file_bytes(image))}
        return self._call("POST", "/v1/templates", data=data, files=files).json()

    def templates(self, query: str = "", tag: str = "") -> list[dict]:
        return self._call("GET", "/v1/templates", params={"query": query, "tag": tag}).json()[
            "templates"
        ]

    def delete_template(self, template_id: str) -> None:
        self._call("DELETE", f"/v1/templates/{template_id}")

    def prepare_template(
        self,
        template_id: str,
        model: str | None = None,
        steps: int | None = None,
        resolution=0,
        adapters=None,
    ) -> dict:
        """Record the template's activation cache for edits with these settings (``adapters``,
        ``[(adapter id, scale), ...]``: pinned to that set, read by edits naming exactly it);
        returns the 202 body (job_id, status_url, cache_url)."""
        data = {"resolution": resolution} | {
            k: v for k, v in (("model", model), ("steps", steps)) if v is not None
        }
        if adapters:
            data["adapters"] = adapters_field(adapters)
        return self._call("POST", f"/v1/templates/{template_id}/prepare", data=data).json()

    # ----- jobs -----------------------------------------------------------------------------------
    def submit(
        self,
        mask: str | Path | bytes,
        prompt: str = "",
        template_id: str | None = None,
        image: str | Path | bytes | None = None,
        **params,
    ) -> dict:
        """Submit an edit; ``params``: negative_prompt, model, steps, guidance, strength, seed,
        threshold, invert, grow_px, feather_px, fill_holes, min_area_px, mode ("generate" or
        "erase": filled from the surroundings, no prompt needed), inpaint_area ("whole" or
        "masked": a padded crop around the mask, edited at the model's resolution and pasted
        back), crop_padding_px (that crop's context around the mask, 0..1024), resolution,
        use_cache, adapters (LoRA adapters: ``[(adapter id, scale), ...]``, up to the server's
        limit), service_class ("interactive" or "batch", the default), deadline_s (seconds from
        now; default: the class's target), priority (0..9, higher first) (None values are left
        out). Returns the 202 body: job_id, seed, status_url, events_url, result_url. A job
        refused by admission control raises ``MaskServeError`` 429 with ``retry_after``."""
        data = _edit_fields(prompt, template_id, params)
        files = {"mask": (_file_name(mask, "mask.png"), _file_bytes(mask))}
        if image is not None:
            files["image"] = (_file_name(image, "image.png"), _file_bytes(image))
        return self._call("POST", "/v1/jobs", data=data, files=files).json()

    def get(self, job_id: str) -> dict:
        return self._call("GET", f"/v1/jobs/{job_id}").json()

    # ----- batches --------------------------------------------------------------------------------
    def submit_batch(
        self,
        masks=(),
        prompts=(),
        mask: str | Path | bytes | None = None,
        prompt: str = "",
        template_id: str | None = None,
        image: str | Path | bytes | None = None,
        **params,
    ) -> dict:
        """Submit one template with many ``masks`` (paths or bytes) and/or ``prompts``: one item
        per mask, per prompt, or per (mask, prompt) pair (docs/api.md says how they pair); ``mask``
        / ``prompt``: the one of items that have none. ``params`` as for ``submit`` (item i runs
        with ``seed + i`` when a seed is given). Returns the 202 body: batch_id, items (index,
        job_id, seed), status_url, events_url, results_url."""
        data = _edit_fields(prompt, template_id, params) | {"prompts": list(prompts)}
        files = [
            ("masks", (_file_name(m, f"mask-{i}.png"), _file_bytes(m))) for i, m in enumerate(masks)
        ]
        if mask is not None:
            files.append(("mask", (_file_name(mask, "mask.png"), _file_bytes(mask))))
        if image is not None:
            files.append(("image", (_file_name(image, "image.png"), _file_bytes(image))))
        return self._call("POST", "/v1/batches", data=data, files=files).json()

    def batch(self, batch_id: str) -> dict:
        """The batch: status, total, finished, counts, progress, and every item's state."""
        return self._call("GET", f"/v1/batches/{batch_id}").json()

    def cancel_batch(self, batch_id: str) -> dict:
        return self._call("DELETE", f"/v1/batches/{batch_id}").json()

    def batch_zip(self, batch_id: str) -> bytes:
        """Every finished result (``<index>.png``) and ``manifest.json``, as a zip."""
        return self._call(
            "GET", f"/v1/batches/{batch_id}/results.zip", timeout=UPLOAD_TIMEOUT_S
        ).content

    def wait_batch(
        self, batch_id: str, timeout: float = 3600.0, on_event=None, poll_s: float = 1.0
    ) -> dict:
        """Block until every item finished; returns the batch (``batch``). Follows the batch's
        event stream (``on_event(message)`` for each: ``type`` ``item`` or ``batch``), polling when
        it cannot be read. TimeoutError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                path = f"/v1/batches/{batch_id}/events"
                for message in self._stream(path, {}, max(1.0, deadline - time.monotonic())):
                    if on_event is not None:
                        on_event(message)
            except httpx.TransportError:  # dropped, or read timeout: check, then go on
                pass
            state = self.batch(batch_id)
            if state["finished"] == state["total"]:
                return state
            time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
        raise TimeoutError(f"batch {batch_id} did not finish within {timeout:.0f} s")

    def jobs(self, limit: int = 50) -> list[dict]:
        """This key's own jobs, newest first."""
        return self._call("GET", "/v1/jobs", params={"limit": limit}).json()["jobs"]

    def cancel(self, job_id: str) -> dict:
        return self._call("DELETE", f"/v1/jobs/{job_id}").json()

    def result_bytes(self, job_id: str, thumbnail: bool = False) -> bytes:
        return self._call(
            "GET", f"/v1/jobs/{job_id}/result", params={"thumbnail": 1} if thumbnail else None
        ).content

    def events(self, job_id: str, after: str | None = None, timeout: float | None = None):
        """Yield the job's events (dicts, each with its ``id``) from its event stream until it ends,
        or until ``timeout`` seconds have passed (keep-alive comments do not extend it)."""
        headers = {"Last-Event-ID": after} if after else {}
        yield from self._stream(f"/v1/jobs/{job_id}/events", headers, timeout)

    def _stream(self, path: str, headers: dict, timeout: float | None):
        """The server-sent messages of ``path`` (dicts, each with its ``id``) until the stream ends
        or ``timeout`` seconds have passed."""
        until = None if timeout is None else time.monotonic() + timeout
        read_timeout = httpx.Timeout(10.0, read=timeout)
        with self.http.stream("GET", path, headers=headers, timeout=read_timeout) as response:
            if response.status_code >= 400:
                response.read()
                self._call_error(response)
            event_id, data = None, []
            for line in response.iter_lines():
                if until is not None and time.monotonic() > until:
                    return
                if line.startswith("id:"):
                    event_id = line[3:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].strip())
                elif line == "" and data:
                    yield {"id": event_id, **json.loads("\n".join(data))}
                    event_id, data = None, []

    @staticmethod
    def _call_error(response: httpx.Response):
        raise _error_of(response)

    def wait(self, job_id: str, timeout: float = 600.0, on_event=None, poll_s: float = 1.0) -> dict:
        """Block until the job finishes; returns its final state (``get``). Follows the event stream
        (``on_event(event)`` for each), reconnecting from the last event id if it drops; falls back
        to polling when the stream cannot be read. TimeoutError after ``timeout`` seconds."""
        deadline, last_id = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            try:
                for event in self.events(
                    job_id, after=last_id, timeout=max(1.0, deadline - time.monotonic())
                ):
                    last_id = event.get("id") or last_id
                    if on_event is not None:
                        on_event(event)
                    if event.get("status") in TERMINAL:
                        return self.get(job_id)
            except httpx.TransportError:  # dropped, or read timeout: check, then go on
                pass
            state = self.get(job_id)
            if state["status"] in TERMINAL:
                return state
            time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
        raise TimeoutError(f"job {job_id} did not finish within {timeout:.0f} s")


def add_connection_arguments(parser) -> None:
    """``--url`` and ``--api-key``, which ``connection`` reads."""
    parser.add_argument(
        "--url", default=None, help="API base URL (default: http://<api host>:<api port>)"
    )
    parser.add_argument(
        "--api-key",
        dest="api_key",
        default=None,
        help="X-API-Key (default: the first raw key in MASKSERVE_API_KEYS, else the key "
        "`maskserve up` wrote to <data dir>/api_key)",
    )


def connection(args, settings=None) -> tuple[str, str | None]:
    """(API base URL, API key) from ``args``, else from ``settings`` (the local stack)."""
    url = getattr(args, "url", None) or (
        f"http://{settings.api.host}:{settings.api.port}" if settings else "http://127.0.0.1:8000"
    )
    return url, getattr(args, "api_key", None) or _settings_api_key(settings)


def adapters_field(adapters) -> str:
    """The ``adapters`` form field of ``[(adapter id, scale), ...]``."""
    return json.dumps([{"id": i, "scale": float(s)} for i, s in adapters])


def adapter_choice(text: str) -> tuple[str, float]:
    """``ID[:SCALE]`` -> (adapter id, scale), for ``--adapter``."""
    adapter_id, _, scale = text.partition(":")
    try:
        return adapter_id, float(scale) if scale else 1.0
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give an adapter as ID or ID:SCALE (a number, e.g. abc123:0.8)"
        ) from None


def add_submit_arguments(parser) -> None:
    """The arguments ``submit_cli`` reads, for an argparse (sub)parser."""
    add_connection_arguments(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--image", help="image file to edit")
    source.add_argument("--template-id", dest="template_id", help="gallery template to edit")
    parser.add_argument(
        "--mask",
        default=None,
        help="mask file: 255 = repaint, same size as the image (with --prompts: one mask for "
        "every prompt)",
    )
    parser.add_argument(
        "--masks",
        default=None,
        metavar="DIR",
        help="a batch: every image file in DIR (sorted by name) is one item's mask",
    )
    parser.add_argument(
        "--prompts",
        default=None,
        metavar="FILE",
        help="a batch: one prompt per line; with --mask, one item per prompt; with --masks, "
        "as many prompts as masks (paired in order) or one prompt",
    )
    parser.add_argument("--prompt", default="")
    parser.add_argument("--negative-prompt", dest="negative_prompt", default=None)
    parser.add_argument("--model", default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--guidance", type=float, default=None)
    parser.add_argument("--strength", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    parser.add_argument("--threshold", type=int, default=None)
    parser.add_argument("--invert", action="store_true")
    parser.add_argument("--grow-px", dest="grow_px", type=int, default=None)
    parser.add_argument("--feather-px", dest="feather_px", type=float, default=None)
    parser.add_argument(
        "--fill-holes",
        dest="fill_holes",
        action="store_true",
        help="fill what a closed painted outline encloses (lasso)",
    )
    parser.add_argument(
        "--min-area-px",
        dest="min_area_px",
        type=int,
        default=None,
        help="drop painted specks smaller than this many pixels",
    )
    parser.add_argument(
        "--mode",
        choices=["generate", "erase"],
        default=None,
        help="generate (default: the model paints the prompt) or erase (the painted area is "
        "filled from its surroundings at once; no prompt needed)",
    )
    parser.add_argument(
        "--inpaint-area",
        dest="inpaint_area",
        choices=["whole", "masked"],
        default=None,
        help="whole (default: the model edits the whole image) or masked (a padded crop around "
        "the mask, edited at the model's resolution and pasted back: more detail for a small "
        "mask on a large image)",
    )
    parser.add_argument(
        "--crop-padding",
        dest="crop_padding_px",
        type=int,
        default=None,
        help="pixels of context around the mask in the masked-area crop (default 32, 0..1024)",
    )
    parser.add_argument("--resolution", type=int, default=None)
    parser.add_argument("--no-cache", dest="no_cache", action="store_true")
    parser.add_argument(
        "--adapter",
        dest="adapters",
        action="append",
        type=adapter_choice,
        metavar="ID[:SCALE]",
        help="a LoRA adapter (maskserve adapters list) and its scale (default 1); repeat for more",
    )
    parser.add_argument(
        "--class",
        dest="service_class",
        choices=["interactive", "batch"],
        default=None,
        help="service class: interactive (someone waits for it) or batch (default); each has a "
        "target latency, the default deadline",
    )
    parser.add_argument(
        "--deadline-s",
        dest="deadline_s",
        type=float,
        default=None,
        help="seconds from now by which the result should be stored (default: the class's target)",
    )
    parser.add_argument(
        "--priority", type=int, default=None, help="0..9, higher goes first (default 0)"
    )
    parser.add_argument(
        "--no-wait", dest="wait", action="store_false", help="print the job id and return"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds to wait for the result (default 600; a batch: 3600)",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="where to write the result PNG (default: <job id>.png); a batch: the directory for "
        "its results and manifest.json (default: batch-<batch id>)",
    )


def _settings_api_key(settings) -> str | None:
    """The first raw key of ``MASKSERVE_API_KEYS``, else the key ``maskserve up`` wrote to
    ``<data_dir>/api_key`` (a ``sha256:`` entry is a digest, not a key one could send)."""
    if settings is None:
        return None
    raw_keys = [key for key in settings.api.api_keys if not key.startswith(API_KEY_DIGEST_PREFIX)]
    if raw_keys:
        return raw_keys[0]
    from backend.services.stack import saved_stack_api_key  # the CLI's path only

    return saved_stack_api_key(settings) or None


def submit_cli(args, settings=None) -> int:
    """`maskserve submit`: submit one edit, wait for it, write the result (with ``--masks`` /
    ``--prompts``: a batch, ``backend.batch_cli``). Prints JSON lines (the accepted job, then the
    final state). Exit status: 0 done (or submitted with --no-wait), 1
    failed, cancelled or timed out, 2 refused by the server or unreachable. ``settings`` (optional)
    supplies the URL and key when ``args`` leaves them out."""
    url, api_key = connection(args, settings)
    params = _submit_params(args)
    batch = bool(getattr(args, "masks", None) or getattr(args, "prompts", None))
    if not batch and not getattr(args, "mask", None):
        print("error: give --mask FILE, or --masks DIR and/or --prompts FILE", file=sys.stderr)
        return 2
    try:
        with MaskServeClient(url, api_key) as client:
            if batch:
                from backend.batch_cli import run_batch

                return run_batch(client, args, params)
            job = client.submit(
                args.mask,
                getattr(args, "prompt", "") or "",
                template_id=getattr(args, "template_id", None),
                image=getattr(args, "image", None),
                **params,
            )
            print(json.dumps(job), flush=True)
            if not getattr(args, "wait", True):
                return 0
            final = client.wait(job["job_id"], timeout=getattr(args, "timeout", None) or 600.0)
            report = {
                k: final.get(k)
                for k in ("job_id", "status", "seed", "message", "timings", "met_deadline")
                if k in final
            }
            if final["status"] == "done":
                out = Path(getattr(args, "out", None) or f"{job['job_id']}.png")
                out.write_bytes(client.result_bytes(job["job_id"]))
                report["out"] = str(out)
            print(json.dumps(report), flush=True)
            return 0 if final["status"] == "done" else 1
    except MaskServeError as exc:
        retry = f", retry after {exc.retry_after:g} s" if exc.retry_after is not None else ""
        print(f"error: {exc.message} (HTTP {exc.status}{retry})", file=sys.stderr)
        return 2
    except TimeoutError as exc:  # before OSError, its base class
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (httpx.TransportError, OSError) as exc:
        print(f"error: cannot reach {url} or read a file: {exc}", file=sys.stderr)
        return 2


def _submit_params(args) -> dict:
    """The edit parameters of ``maskserve submit``'s arguments (None: the server's default)."""
    params = {
        name: getattr(args, name, None)
        for name in (
            "negative_prompt",
            "model",
            "steps",
            "guidance",
            "strength",
            "seed",
            "threshold",
            "grow_px",
            "feather_px",
            "min_area_px",
            "mode",
            "inpaint_area",
            "crop_padding_px",
            "resolution",
            "service_class",
            "deadline_s",
            "priority",
        )
    }
    params["invert"] = True if getattr(args, "invert", False) else None
    params["fill_holes"] = True if getattr(args, "fill_holes", False) else None
    params["use_cache"] = False if getattr(args, "no_cache", False) else None
    params["adapters"] = getattr(args, "adapters", None)
    return params

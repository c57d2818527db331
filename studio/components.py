"""What the studio's tabs share: the brush, the page's CSS, the signed-in user, the handler
decorator that turns a ``StudioError`` into a warning toast, and the progress bar."""

from __future__ import annotations

import functools
import html

import gradio as gr

from studio.actions import StudioError

BRUSH = gr.Brush(default_size=24, colors=["#ff3030", "#30a0ff", "#ffffff"], color_mode="defaults")
GALLERY_COLUMNS = 3
HISTORY_HEADERS = ["submitted", "status", "prompt", "seed", "steps", "model", "total s", "job"]
# Gradio narrows a gallery's grid to its item count (one template fills the whole width): keep the
# declared columns whatever the count
CSS = """
#ms-pick .grid-container { grid-template-columns: repeat(3, minmax(0, 1fr)) !important; }
#ms-gallery .grid-container { grid-template-columns: repeat(5, minmax(0, 1fr)) !important; }
#ms-results .grid-container { grid-template-columns: repeat(8, minmax(0, 1fr)) !important; }
#ms-progress progress { width: 100%; height: 14px; }
#ms-status { min-height: 2.5em; }
.ms-muted { color: var(--body-text-color-subdued); font-size: 0.9em; }
"""


def user_of(request: gr.Request | None) -> str:
    """The signed-in user (``local`` when auth is disabled)."""
    return (getattr(request, "username", None) or "local") if request is not None else "local"


def handler(n_outputs: int = 1):
    """A handler feeding ``n_outputs`` components: a StudioError becomes a warning toast and every
    output keeps its value."""

    def decorate(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            try:
                return func(*args, **kwargs)
            except StudioError as exc:
                gr.Warning(str(exc))
                return gr.skip() if n_outputs == 1 else tuple(gr.skip() for _ in range(n_outputs))

        return wrapper

    return decorate


def progress_html(progress) -> str:
    bar = ""
    if progress.num_steps:
        bar = f'<progress value="{progress.step}" max="{progress.num_steps}"></progress>'
    return f'<div id="ms-progress">{bar}<div>{html.escape(progress.describe())}</div></div>'

"""What the studio's tabs share: the brush, the page's CSS and script, the signed-in user, the
handler decorator that turns a ``StudioError`` into a warning toast, and the progress bar."""

from __future__ import annotations

import functools
import html

import gradio as gr

from studio.actions import StudioError

BRUSH = gr.Brush(default_size=24, colors=["#ff3030", "#30a0ff", "#ffffff"], color_mode="defaults")
GALLERY_COLUMNS = 3
CANVAS_PLACEHOLDER = "**Pick a template on the left**, then paint over the area to change."
NOTHING_PAINTED = "Mask: nothing painted yet"
PREVIEW_PREFIX = "data:image/png;base64,"  # the only previews the page shows (from the worker)
# the editor's form fields, in the order EditForm is built from them and a recall sets them
FORM_FIELDS = (
    "prompt",
    "negative",
    "model",
    "steps",
    "guidance",
    "strength",
    "random_seed",
    "seed",
    "invert",
    "grow",
    "feather",
    "use_cache",
    "fill_holes",
    "min_area",
    "masked_only",
    "crop_padding",
    "priority",
    "deadline",
)
HISTORY_HEADERS = [
    "submitted",
    "status",
    "prompt",
    "seed",
    "steps",
    "model",
    "adapters",
    "total s",
    "class",
    "deadline",
    "job",
]
# Gradio narrows a gallery's grid to its item count (one template fills the whole width): keep the
# declared columns whatever the count
CSS = """
#ms-pick .grid-container { grid-template-columns: repeat(3, minmax(0, 1fr)) !important; }
#ms-gallery .grid-container { grid-template-columns: repeat(5, minmax(0, 1fr)) !important; }
#ms-results .grid-container { grid-template-columns: repeat(8, minmax(0, 1fr)) !important; }
#ms-pick .caption-label { white-space: normal; max-width: 100%; left: 0; line-height: 1.2;
  font-size: 0.75em; max-height: 3.8em; overflow: hidden; }
#ms-progress progress { width: 100%; height: 14px; }
#ms-status { min-height: 2.5em; }
.ms-previews { display: flex; gap: 6px; margin-top: 6px; }
.ms-preview { width: 128px; height: auto; image-rendering: auto; border-radius: 4px; }
.ms-muted { color: var(--body-text-color-subdued); font-size: 0.9em; }
/* the History's headers wrap between words only (its table's wrapping breaks words anywhere) */
#ms-history th .text { word-break: keep-all; overflow-wrap: normal; }
"""

# Run once on page load. Gradio's ImageEditor (6.31, pinned) sizes a layer it loads from a URL (a
# mask recalled from the History or dropped on the editor) by the bounds of everything on its
# canvas, the brush's stroke preview included, which keeps the size of an earlier canvas (800x800
# until the first stroke), and centres the layer's picture in those bounds: the mask then lands
# down and right of its place, partly off the image. The editor's loader is sized by the picture
# (its background layer) instead; it reads the bounds before its first await, so they are put
# back when it returns. The editor publishes its canvas object as window.editor once mounted.
EDITOR_JS = """
() => {
  const sizeLayersByPicture = () => {
    const manager = window.editor && window.editor.layer_manager;
    if (!manager) return false;
    const loader = Object.getPrototypeOf(manager);
    if (loader.msSizedByPicture) return true;
    const load = loader.add_layer_from_url;
    loader.add_layer_from_url = function (url) {
      const picture = this.background_layer;
      if (!picture) return load.call(this, url);
      this.image_container.getLocalBounds = () => picture.getLocalBounds();
      try {
        return load.call(this, url);
      } finally {
        delete this.image_container.getLocalBounds;
      }
    };
    loader.msSizedByPicture = true;
    return true;
  };
  if (!sizeLayersByPicture()) {
    const waiting = setInterval(() => sizeLayersByPicture() && clearInterval(waiting), 50);
  }
}
"""


def user_of(request: gr.Request | None) -> str:
    """The signed-in user (``local`` when auth is disabled)."""
    return (getattr(request, "username", None) or "local") if request is not None else "local"


def unchanged(n_outputs: int):
    """What a handler feeding ``n_outputs`` components returns to leave every one as it is."""
    return gr.skip() if n_outputs == 1 else tuple(gr.skip() for _ in range(n_outputs))


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
                return unchanged(n_outputs)

        return wrapper

    return decorate


def progress_html(progress) -> str:
    """A progress bar and a line per job: ``progress`` is one ``Progress`` or a list of them (the
    variations of one Generate, numbered)."""
    many = isinstance(progress, list) and len(progress) > 1
    rows = []
    for number, one in enumerate(progress if isinstance(progress, list) else [progress], 1):
        bar = ""
        if one.num_steps:
            bar = f'<progress value="{one.step}" max="{one.num_steps}"></progress>'
        label = f"{number}: " if many else ""
        rows.append(f"{bar}<div>{label}{html.escape(one.describe())}</div>")
    previews = [
        f'<img class="ms-preview" alt="live preview" src="{html.escape(one.preview)}">'
        for one in (progress if isinstance(progress, list) else [progress])
        if one.preview.startswith(PREVIEW_PREFIX) and not one.finished
    ]
    shown = f'<div class="ms-previews">{"".join(previews)}</div>' if previews else ""
    return f'<div id="ms-progress">{"".join(rows)}{shown}</div>'

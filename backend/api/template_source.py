"""A job's template and mask as the job service checks them: the template resolved (a gallery
template of the caller, or an uploaded image) and decoded once, a mask checked against it, the
template's blob written only when asked.

Invariants: nothing here writes a blob before ``CheckedTemplate.store`` is called, so a refused
request stores nothing; a template is checked once however many masks are checked against it (a
batch: ``backend.api.batches``); another owner's gallery template is ``not_found``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from backend.api.checks import ServiceError
from backend.api.service_levels import mask_ratio_estimate
from backend.blobs import BlobStore
from backend.config import Settings
from backend.imaging.erase import require_erasable
from backend.imaging.masks import MaskError, feather_support
from backend.imaging.uploads import UploadError, decode_image, process_mask, require_edit_size
from backend.protocol import MaskOps
from templates_store.store import TemplateNotFound, TemplateStore, upload_error_code


@dataclass(frozen=True)
class CheckedTemplate:
    """A template that passed its checks: its (width, height) and ``store``, which writes its
    blob (once per call: the blob is named by content, so calling it again writes nothing new) and
    returns the ref."""

    size: tuple[int, int]
    store: Callable[[], str]
    template_id: str = ""  # the gallery template's id; "" for an upload


class TemplateSource:
    def __init__(self, settings: Settings, blobs: BlobStore, templates: TemplateStore):
        self.settings, self.blobs, self.templates = settings, blobs, templates

    def owned(self, template_id: str, owner: str):
        """``owner``'s gallery template record; ``not_found`` for another owner's."""
        try:
            return self.templates.get(template_id, owner)
        except TemplateNotFound as exc:
            raise ServiceError(str(exc), "not_found") from None

    def check(self, template_id: str | None, image: bytes | None, owner: str) -> CheckedTemplate:
        """Exactly one of ``template_id`` and ``image``, within the upload limit and decodable;
        nothing is stored."""
        if (template_id is None) == (image is None):
            raise ServiceError(
                "give exactly one of template_id (a gallery template) and image (an uploaded file)",
                field="image",
            )
        limit = self.settings.celery.max_upload_pixels
        if template_id is not None:
            record = self.owned(template_id, owner)
            if record.width * record.height > limit:
                raise ServiceError(
                    f"template is {record.width}x{record.height}, over this deployment's limit of "
                    f"{limit / 1e6:.1f} MP: upload a smaller template",
                    "too_large",
                    field="template_id",
                )
            return CheckedTemplate(
                (record.width, record.height), lambda: self.blob(record), template_id
            )
        decoded, data = self.decode(image, "image"), image or b""
        return CheckedTemplate(
            decoded.size, lambda: self.blobs.put_content("uploads", data, ".img")
        )

    def blob(self, record) -> str:
        """The template's PNG as an ``uploads`` blob, named by its content hash like
        ``put_content`` names it: copied once, shared by every job that edits this template."""
        ref = self.blobs.ref("uploads", record.sha256[:32] + ".png")
        try:
            # reused by a new job: its retention starts again (backend.janitor)
            self.blobs.touch(ref)
        except FileNotFoundError:
            self.blobs.put_content("uploads", self.image_bytes(record), ".png")
        return ref

    def image_bytes(self, record) -> bytes:
        try:
            return self.templates.image_path(record.id, record.owner).read_bytes()
        except (TemplateNotFound, FileNotFoundError):
            raise ServiceError(str(TemplateNotFound(record.id)), "not_found") from None

    def mask_ratio(
        self,
        mask: bytes,
        image_size: tuple[int, int],
        mask_ops: MaskOps,
        mode: str,
        inpaint_area: str,
    ) -> float:
        """The mask's ratio as far as it can be told here (``mask_ratio_estimate``), after the
        pre task's own mask steps: a mask that ends up empty is refused now, not later."""
        decoded = self.decode(mask, "mask")
        try:
            processed = process_mask(decoded, image_size, mask_ops)
            if mode == "erase":
                require_erasable(feather_support(processed, mask_ops.feather_px))
        except MaskError as exc:
            raise ServiceError(str(exc), field="mask") from None
        return mask_ratio_estimate(processed, inpaint_area)

    def decode(self, data: bytes | None, what: str):
        """``what``: ``image`` or ``mask`` (the request's fields), or ``template`` (a gallery
        template's, named by ``template_id``)."""
        try:
            image = decode_image(data or b"", self.settings.celery.max_upload_pixels, what=what)
            require_edit_size(image.size, what)
            return image
        except UploadError as exc:
            field = "template_id" if what == "template" else what
            raise ServiceError(str(exc), upload_error_code(exc), field=field) from None

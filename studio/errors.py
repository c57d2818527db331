"""The one error the studio shows its users, and the conversion of the service layer's errors to it.

Invariant: every error a user can cause in the service layer (a bad field, an unknown or deleted
template or adapter, a bad mask, an adapter the request may not use) reaches the page as a
``StudioError`` whose message says what to fix; anything else is a bug and propagates.
"""

from __future__ import annotations

from backend.adapters.store import AdapterError, AdapterNotFound
from backend.api.service import ServiceError
from backend.imaging.masks import MaskError
from templates_store.store import TemplateError, TemplateNotFound


class StudioError(ValueError):
    """Something the user must fix; the message says what."""


def service_call(func, *args, **kwargs):
    """``func(*args, **kwargs)``, with the service layer's user errors raised as ``StudioError``."""
    try:
        return func(*args, **kwargs)
    except (ServiceError, TemplateError, MaskError, AdapterError) as exc:
        raise StudioError(str(exc)) from None
    except TemplateNotFound as exc:
        raise StudioError(f"{exc} (it may have been deleted: refresh the gallery)") from None
    except AdapterNotFound as exc:
        raise StudioError(f"{exc} (it may have been deleted: refresh the adapters)") from None

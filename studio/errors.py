"""The one error the studio shows its users, and the conversion of the service layer's errors to it.

Invariant: every error a user can cause in the service layer (a bad field, an unknown or deleted
template or adapter, a bad mask, an adapter the request may not use) reaches the page as a
``StudioError`` whose message says what to fix; anything else is a bug and propagates.

Admission control's refusal (``Overloaded``, what REST answers with 429 and ``Retry-After``) is one
of them: its message gives the API's reason and "Retry in N s" (``busy_message``), and the error
carries ``retry_after_s``.
"""

from __future__ import annotations

import re

from backend.adapters.store import AdapterError, AdapterNotFound
from backend.api.checks import Overloaded
from backend.api.service import ServiceError
from backend.imaging.masks import MaskError
from templates_store.store import TemplateError, TemplateNotFound

# the reason in admission control's message: "<class> job refused (<bound> bound): <why>. Retry ..."
_WHY = re.compile(r"refused \(\w+ bound\): (?P<why>.+?)\. Retry in", re.DOTALL)


class StudioError(ValueError):
    """Something the user must fix; the message says what. ``retry_after_s``: when the service
    was too busy to take the edit, the seconds after which to try again (else None)."""

    def __init__(self, message: str, retry_after_s: int | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


def busy_message(exc: Overloaded) -> str:
    """Admission control's refusal in the studio's words: the API's reason (its REST field names
    turned into the editor's), then when to retry."""
    found = _WHY.search(str(exc))
    why = found.group("why") if found else str(exc).rstrip(".")
    why = why.replace("give deadline_s of", "set Deadline (s) under More settings to").replace(
        "deadline_s", "Deadline (s)"
    )
    retry = f"Retry in {exc.retry_after_s} s"
    if (exc.detail or {}).get("reason") == "deadline" and "More settings" not in why:
        retry += ", or give a longer Deadline (s) under More settings"
    return f"The service is too busy to take this edit now: {why}. {retry}."


def service_call(func, *args, **kwargs):
    """``func(*args, **kwargs)``, with the service layer's user errors raised as ``StudioError``."""
    try:
        return func(*args, **kwargs)
    except Overloaded as exc:
        raise StudioError(busy_message(exc), exc.retry_after_s) from None
    except (ServiceError, TemplateError, MaskError, AdapterError) as exc:
        raise StudioError(str(exc)) from None
    except TemplateNotFound as exc:
        raise StudioError(f"{exc} (it may have been deleted: refresh the gallery)") from None
    except AdapterNotFound as exc:
        raise StudioError(f"{exc} (it may have been deleted: refresh the adapters)") from None

"""Models of the three inpainting families.

``catalog`` (ids, families, traits, defaults) never imports torch and is what every role may use;
``registry`` builds and loads weights and is imported by the roles that run a model. The loading
names below are imported on first use, so importing this package stays torch-free.
"""

from backend.models.catalog import (
    FAMILIES,
    FAMILY_TRAITS,
    FORMS,
    FamilyTraits,
    ModelSpec,
    UnknownModelError,
    known_model_ids,
    resolve_model,
    rows_per_request,
)

_LOADING = ("load_pipeline", "materialize", "model_revision", "pipeline_class")

__all__ = [
    "FAMILIES",
    "FAMILY_TRAITS",
    "FORMS",
    "FamilyTraits",
    "ModelSpec",
    "UnknownModelError",
    "known_model_ids",
    "resolve_model",
    "rows_per_request",
    *_LOADING,
]


def __getattr__(name: str):
    if name in _LOADING:
        from backend.models import registry

        return getattr(registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

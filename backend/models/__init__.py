"""Model registry of the three inpainting families (see ``registry``)."""

from backend.models.registry import (FAMILIES, FORMS, ModelSpec, UnknownModelError, known_model_ids,
                                     load_pipeline, materialize, pipeline_class, resolve_model)

__all__ = ["FAMILIES", "FORMS", "ModelSpec", "UnknownModelError", "known_model_ids", "load_pipeline",
           "materialize", "pipeline_class", "resolve_model"]

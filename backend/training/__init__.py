"""Training the demo inpainting model: the scenes it learns from (``scenes``)."""

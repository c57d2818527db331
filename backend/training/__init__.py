"""Training the demo inpainting model: the scenes it learns from (``scenes``) and the inpainting
examples made of them (``examples``: image, painted mask, caption of what lies under it)."""

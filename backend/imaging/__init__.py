"""Image-side helpers: pixel/token masks and quality metrics (numpy + PIL only)."""

"""The cost model: pure (no torch, no redis), shared by the engine's planner and the router.

``costs`` fits and evaluates per-unit cost lines, ``plan`` solves the bubble-free loading plan
(FlashPS Algorithm 1) and ``profiles`` names and reads the fitted profile files.
"""

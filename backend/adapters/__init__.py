"""LoRA adapters as users have them: files read through diffusers' own loaders, normalized, stored.

* ``store``: the adapter registry's records and content files (no torch; the API imports it);
* ``service``: the API's side of an upload: stage it, have a CPU worker ingest it, store it;
* ``files``: reading user files (diffusers/PEFT or kohya layout) and the normalized format
  (torch and diffusers; CPU workers and engine workers);
* ``ingest``: the CPU worker's task body (read, validate against the model, normalize).
"""

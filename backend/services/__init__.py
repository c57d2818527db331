"""Services MaskServe runs for itself when none is given (a local Redis server)."""

"""Moving bytes between sidecars: the NIXL agent and its single driver thread."""

"""mesh-host: the agent on every machine. Registers, beats, and (later) applies its declaration."""

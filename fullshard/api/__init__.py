"""The user-facing doors onto the engine: `fsdp()`, `FSDPStrategy` and `Fabric`."""

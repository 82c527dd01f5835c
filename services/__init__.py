"""The mesh's own services, each with the module.toml the mesh deploys it with."""

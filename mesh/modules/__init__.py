"""Modules: the manifest (`module.toml`), the registration gate, source archives, composition of
each machine's declaration and the diff between two declarations. Pure logic over Structs:
nothing here does I/O beyond reading the module folder it is given."""

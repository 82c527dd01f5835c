"""Credentials and permissions: who may connect to the mesh's NATS and what each may do there.

`keys` makes nkeys, `creds` reads and writes credentials files, `policy` says what each kind of
user may publish and subscribe to, `server` renders that as nats-server configuration and
reloads a running server, `registry` keeps a mesh's users in its folder (see `mesh.meshdir`).
"""

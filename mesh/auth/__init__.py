"""Credentials and permissions: who may connect to the mesh's NATS and what each may do there.

`keys` makes nkeys, `claims` NATS JWTs, `trust` keeps the mesh's operator, accounts and signing
key (what the servers are given, and each identity's JWT), `creds` reads and writes credentials
files, `policy` says what each kind of user may publish and subscribe to, `server` writes what
the servers include and pushes a revocation to the running ones, `registry` keeps a mesh's users
in its folder (see `mesh.meshdir`).
"""

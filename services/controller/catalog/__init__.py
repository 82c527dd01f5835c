"""The catalog's parts: a push's steps before anything is stored, bundles and builds,
versions, scopes, the key of the secrets."""

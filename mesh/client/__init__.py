"""The client side of the verbs, beside `mesh/serving.py`, their serving side: a connection for
one client and a verb asked with retries (`asking`), a list verb's pages followed to one list
(`pages`), the fleet's tools listed and called (`tools`), a plan followed as its holder tells
its progress (`progress`). The command line, the console, `mesh mcp`, `mesh dev up`, `mesh init`
and the benches ask through it; its one error is `asking.VerbFailed`, a MeshError."""

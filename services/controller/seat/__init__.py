"""The seat: who holds `mesh-controller`, how it is taken, handed over and given up
(docs/architecture.md, the seat)."""

"""Where an apply stopped, as the host reports it (`Applied.step`, `Applied.error`)."""

from mesh.model import ApplyStepKind, apply_step


class StepFailed(Exception):
    """Where an apply stopped (its step's kind, and the name of what it acts on, if any) and
    why; `step` as `Applied.step` says it."""

    def __init__(self, kind: ApplyStepKind, error: str, *, name: str = "") -> None:
        self.kind = kind
        self.step = apply_step(kind, name)
        self.error = error
        super().__init__(f"{self.step}: {error}")

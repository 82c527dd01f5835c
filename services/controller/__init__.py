"""mesh-controller: holds the `mesh-controller` seat, answers the verbs, watches the fleet."""
